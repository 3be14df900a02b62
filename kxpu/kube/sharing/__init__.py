"""Fractional sharing's API traffic, on ``kxpu.kube``'s client: the extender's caches fed by watches
(``informer``), node locks and bind (``api``, ``lease``), signing keys (``keys``), the node daemon's link
(``node``).

The protocol itself (lock text, signatures, placement) is ``kxpu.sharing``'s pure core, which these
modules call; ``kxpu.sharing`` reaches the API server only through them.
"""
