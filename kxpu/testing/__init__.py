"""Kits for testing backends and the daemon without a cluster.

The kubelet stand-in (gRPC) is imported on first use, so that a vendor fake (``kxpu.testing.fake_nvml``)
imports on a machine whose grpcio does not match the generated code, as on a lent GPU machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kxpu.testing.kubelet import KubeletStandIn, PluginView

__all__ = ["KubeletStandIn", "PluginView"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kxpu.testing import kubelet

        return getattr(kubelet, name)
    raise AttributeError(f"module 'kxpu.testing' has no attribute {name!r}")
