"""Fractional accelerator sharing: pure fit/score/sign core, extender, webhook, node wrapper.

``model``, ``requests``, ``fit``, ``policy``, ``inventory``, ``signing`` and ``state`` are
pure (no Kubernetes imports); ``kube/`` is the thin API layer; ``extender`` and
``webhook`` are the HTTP servers; ``node`` wraps a vendor backend on the node.
"""
