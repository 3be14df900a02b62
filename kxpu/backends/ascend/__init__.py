"""The ``ascend`` backend: Huawei Ascend NPUs through DCMI (ctypes), drop-in for Huawei's and HAMi's plugins."""

from kxpu.backends.ascend.backend import AscendBackend
from kxpu.backends.ascend.config import AscendConfig

__all__ = ["AscendBackend", "AscendConfig"]
