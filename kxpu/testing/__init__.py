"""Kits for testing backends and the daemon without a cluster."""

from kxpu.testing.kubelet import KubeletStandIn, PluginView

__all__ = ["KubeletStandIn", "PluginView"]
