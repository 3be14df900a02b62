"""The ``gaudi`` backend: Intel Gaudi through HLML (habana-pyhlml), drop-in for Habana's device plugin."""

from kxpu.backends.gaudi.backend import GaudiBackend
from kxpu.backends.gaudi.config import GaudiConfig

__all__ = ["GaudiBackend", "GaudiConfig"]
