"""The ``nvidia`` backend: GPUs and MIG devices through NVML (nvidia-ml-py), drop-in for NVIDIA's plugin."""

from kxpu.backends.nvidia.backend import NvidiaBackend
from kxpu.backends.nvidia.config import NvidiaConfig

__all__ = ["NvidiaBackend", "NvidiaConfig"]
