"""Scenario 7: the generic backend hands real device nodes to a container, with their cgroup permissions."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from e2e import kube
from e2e.conftest import E2E

FPGA = "example.com/fpga"
FPGA_RO = "example.com/fpga-ro"
# A character device number with no driver, outside the runtime's default device allowlist (which already grants
# 1:3 and friends to every container): opening it is refused by the device cgroup (EPERM) unless the container
# was granted that access, and otherwise fails in the kernel with ENXIO. That tells the granted access apart.
UNLISTED = (240, 0)

SCRIPT = r"""
echo "FPGA_VISIBLE_DEVICES=$FPGA_VISIBLE_DEVICES"
for d in /dev/fpga_accel/* /dev/fpga_ro/*; do echo "node $(stat -c '%n %F %t:%T' "$d")"; done
for d in /dev/fpga_accel/*; do
  if echo data > "$d"; then echo "write-ok $d"; fi
  if head -c 1 "$d" > /dev/null; then echo "read-ok $d"; fi
done
for d in /dev/fpga_ro/*; do
  (echo data > "$d") 2> /tmp/err; echo "write $d: $(cat /tmp/err)"
  (cat "$d" > /dev/null) 2> /tmp/err; echo "read $d: $(cat /tmp/err)"
done
echo end-of-report
"""


def _mknod(path: Path, major: int, minor: int) -> None:
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    path.chmod(0o666)


def test_generic_device_nodes(e2e: E2E, tmp_path: Path) -> None:
    """7. Device nodes made with mknod appear at the configured container paths with the configured access."""
    devdir = tmp_path / "dev"
    devdir.mkdir()
    for i in range(3):
        _mknod(devdir / f"fpga{i}", 1, 3)  # copies of /dev/null: readable and writable when granted "rw"
    _mknod(devdir / "rofpga0", *UNLISTED)
    e2e.kxpu(
        [
            {
                "name": FPGA,
                "generic": {
                    "groups": [
                        {
                            "paths": [str(devdir / "fpga*")],
                            "containerPath": "/dev/fpga_accel/{name}",
                            "permissions": "rw",
                            "env": {"FPGA_VISIBLE_DEVICES": "{ids}"},
                        }
                    ]
                },
            },
            {
                "name": FPGA_RO,
                "generic": {
                    "groups": [
                        {
                            "paths": [str(devdir / "rofpga*")],
                            "containerPath": "/dev/fpga_ro/{name}",
                            "permissions": "r",
                        }
                    ]
                },
            },
        ]
    )
    kube.wait_resource(e2e.cluster, FPGA, allocatable=3, capacity=3)
    kube.wait_resource(e2e.cluster, FPGA_RO, allocatable=1, capacity=1)

    pod = e2e.pod("nodes", SCRIPT, {FPGA: 2, FPGA_RO: 1})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")

    match = re.search(r"^FPGA_VISIBLE_DEVICES=(.*)$", log, re.M)
    assert match, log
    ids = sorted(match.group(1).split(","))
    assert len(ids) == 2 and set(ids) <= {"fpga0", "fpga1", "fpga2"}, log
    nodes = dict(re.findall(r"^node (\S+) (character special file \S+)$", log, re.M))
    expected = {f"/dev/fpga_accel/{i}": "character special file 1:3" for i in ids}
    expected["/dev/fpga_ro/rofpga0"] = f"character special file {UNLISTED[0]:x}:{UNLISTED[1]:x}"
    assert nodes == expected, log
    for i in ids:
        assert f"write-ok /dev/fpga_accel/{i}" in log and f"read-ok /dev/fpga_accel/{i}" in log, log
    # "r": reading passes the device cgroup (the kernel then finds no driver); writing is refused by it.
    write = re.search(r"^write /dev/fpga_ro/rofpga0: (.*)$", log, re.M)
    read = re.search(r"^read /dev/fpga_ro/rofpga0: (.*)$", log, re.M)
    assert write and "Operation not permitted" in write.group(1), log
    assert read and "Operation not permitted" not in read.group(1), log
    assert "No such device" in read.group(1), log
