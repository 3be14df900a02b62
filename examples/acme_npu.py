"""A complete kxpu backend: Acme NPUs that the driver lists under /sys/class/acme_npu.

Run it with `kxpu plugin --import acme_npu --config acme.yaml` (acme_npu importable) and:

    version: v1
    resources:
      - name: acme.com/npu
        acme: {classDir: /sys/class/acme_npu}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kxpu import (
    Backend,
    BackendConfig,
    ContainerEdits,
    Device,
    DeviceNode,
    Health,
    numa_packed,
    register_backend,
)


class AcmeConfig(BackendConfig):
    class_dir: Path = Path("/sys/class/acme_npu")
    dev_dir: Path = Path("/dev")


@register_backend("acme", AcmeConfig)
class AcmeBackend(Backend):
    def __init__(self, config: AcmeConfig) -> None:
        self.config = config

    def discover(self) -> list[Device]:
        devices = []
        for entry in sorted(self.config.class_dir.glob("npu*")):
            numa = int((entry / "numa_node").read_text())
            devices.append(
                Device(
                    id=entry.name,
                    uuid=(entry / "uuid").read_text().strip(),
                    health=Health.HEALTHY if (entry / "status").read_text().strip() == "ok" else Health.UNHEALTHY,
                    numa_nodes=(numa,) if numa >= 0 else (),
                    model="acme-npu",
                )
            )
        return devices

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits(
            env={"ACME_VISIBLE_DEVICES": ",".join(d.uuid or d.id for d in devices)},
            device_nodes=[DeviceNode(f"/dev/{d.id}", str(self.config.dev_dir / d.id), "rw") for d in devices],
        )

    # Optional: having this method makes the daemon offer GetPreferredAllocation.
    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        return numa_packed(available, must_include, size)
