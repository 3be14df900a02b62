"""The in-container limits of a container's shares of devices, as HAMi-core reads them.

Both ways kxpu grants shares (the scheduler extender's signed assignment, and DRA's consumable
capacity) give a container the same variables, so one container image works under either. The
names are configurable per resource (HAMi-core's by default); MPS or a vendor's own limits come on
top, from the backend (``ShareAllocator``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kxpu.model.backend import DeviceShare


def share_limit_env(shares: Sequence[DeviceShare], memory_env: str, core_env: str) -> dict[str, str]:
    """``memory_env`` (with ``{i}``, the device's index in the container) = ``<MiB>m`` per device, in order;
    ``core_env`` = the compute percent of the first device when it is a part (HAMi-core takes one value)."""
    env = {memory_env.replace("{i}", str(i)): f"{share.memory_mib}m" for i, share in enumerate(shares)}
    cores = shares[0].cores if shares else 0
    if 0 < cores < 100:
        env[core_env] = str(cores)
    return env
