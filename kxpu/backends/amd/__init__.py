"""AMD Instinct GPUs (``amd:``) and Hygon DCUs (``hygon:``) from the amdgpu driver's sysfs and KFD topology;
amdsmi optional, for ECC health."""

from kxpu.backends.amd.backend import AmdBackend, AmdConfig, HygonBackend, HygonConfig

__all__ = ["AmdBackend", "AmdConfig", "HygonBackend", "HygonConfig"]
