"""Scenario 8: kxpu answers Allocate with CDI device names; containerd applies the spec kxpu wrote."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from e2e import kube
from e2e.configs import NPU, sim_ids, simulated
from e2e.conftest import E2E, kxpu_binary

CDI_DIR = Path("/var/run/cdi")
CDI_DEVICES_FIELD = 5  # ContainerAllocateResponse.cdi_devices (repeated CDIDevice{string name = 1})


def test_cdi_edits_reach_the_container(e2e: E2E, tmp_path: Path) -> None:
    """8. The kubelet gets CDI names from kxpu and the container sees the edits of the spec kxpu wrote."""
    share = tmp_path / "share"
    share.mkdir()
    (share / "marker").write_text("kxpu-e2e-cdi-ok\n")
    resource = simulated(mount_dir=share, cdi={"enabled": True, "specDir": str(CDI_DIR)})
    _require_cdi_config(tmp_path, resource)

    e2e.kxpu([resource])
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    pod = e2e.pod(
        "cdi",
        'echo "SIM_VISIBLE_DEVICES=$SIM_VISIBLE_DEVICES"\necho "marker=$(cat /sim/marker)"\necho end-of-report',
        {NPU: 2},
    )
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    match = re.search(r"^SIM_VISIBLE_DEVICES=(.*)$", log, re.M)
    assert match, log
    ids = set(match.group(1).split(","))
    assert len(ids) == 2 and ids <= sim_ids(), log
    assert "marker=kxpu-e2e-cdi-ok" in log, log

    uid = kube.get_pod(e2e.cluster, pod.name)["metadata"]["uid"]
    entries = [e for e in kube.read_checkpoint() if e.pod_uid == uid and e.resource == NPU]
    assert entries, "the kubelet checkpointed no allocation for the pod"
    names = [n for e in entries for n in cdi_names(e.alloc_response)]
    assert names, "the Allocate response carried no CDI device names"
    for name in names:
        assert re.fullmatch(r"[a-z0-9.-]+/[a-zA-Z0-9_.-]+=[a-zA-Z0-9_.:-]+", name), name
    specs = [p for p in CDI_DIR.glob("*") if p.suffix in (".json", ".yaml")]
    assert specs, f"no CDI spec in {CDI_DIR}"


def _require_cdi_config(tmp: Path, resource: dict[str, object]) -> None:
    """xfail (not fail) while the daemon's config does not know the ``cdi`` key yet."""
    config = tmp / "probe.yaml"
    config.write_text(json.dumps({"version": "v1", "resources": [resource]}))
    proc = subprocess.run(
        [str(kxpu_binary()), "devices", "--config", str(config), "--output", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0 and "cdi" in proc.stderr.lower():
        pytest.xfail(f"kxpu does not accept the resource 'cdi' key yet: {proc.stderr.strip()[:300]}")
    assert proc.returncode == 0, proc.stderr


def cdi_names(raw: bytes) -> list[str]:
    """CDI device names in a serialized ContainerAllocateResponse (a minimal protobuf wire reader)."""
    names = []
    for field, value in _fields(raw):
        if field == CDI_DEVICES_FIELD and isinstance(value, bytes):
            names += [v.decode() for f, v in _fields(value) if f == 1 and isinstance(v, bytes)]
    return names


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            out.append((field, value))
        elif wire == 2:
            size, i = _varint(buf, i)
            out.append((field, buf[i : i + size]))
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return out


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
