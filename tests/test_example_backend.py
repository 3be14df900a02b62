"""The README's custom backend, loaded with --import into a real daemon process."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kxpu.testing import KubeletStandIn

ROOT = Path(__file__).parent.parent


def test_readme_shows_the_example_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert (ROOT / "examples" / "acme_npu.py").read_text() in blocks


def test_example_backend_fits_well_under_100_lines() -> None:
    assert len((ROOT / "examples" / "acme_npu.py").read_text().splitlines()) < 100


async def test_example_backend_serves_through_the_daemon(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    class_dir = workdir / "acme"
    for n, (status, numa) in enumerate([("ok", 0), ("ok", 1), ("ecc-error", 1)]):
        entry = class_dir / f"npu{n}"
        entry.mkdir(parents=True)
        (entry / "uuid").write_text(f"ACME-{n:04d}\n")
        (entry / "status").write_text(status)
        (entry / "numa_node").write_text(str(numa))
    config = write_config(
        [{"name": "acme.com/npu", "acme": {"classDir": str(class_dir), "devDir": "/dev/acme"}}]
    )
    await daemons(config, "--import", "acme_npu", env={"PYTHONPATH": str(ROOT / "examples")})
    view = await kubelet.wait_registered("acme.com/npu")
    assert view.devices == {"npu0": "Healthy", "npu1": "Healthy", "npu2": "Unhealthy"}
    assert view.options.get_preferred_allocation_available
    response = await kubelet.allocate("acme.com/npu", ["npu1"])
    container = response.container_responses[0]
    assert container.envs["ACME_VISIBLE_DEVICES"] == "ACME-0001"
    assert [(d.container_path, d.host_path) for d in container.devices] == [("/dev/npu1", "/dev/acme/npu1")]
