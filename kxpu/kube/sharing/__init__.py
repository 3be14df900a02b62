"""Sharing's adapters over the Kubernetes client (``kxpu.kube``): caches fed by watches, node locks, bind,
the node's inventory and handshake, signing keys.

Everything above it speaks plain dicts and dataclasses; lightkube is imported only here and in ``kxpu.kube``.
"""
