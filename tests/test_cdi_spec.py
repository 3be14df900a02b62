"""CDI spec content against the CDI specification's rules: names, versions, required fields, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kxpu.cdi.config import validate_kind
from kxpu.cdi.spec import (
    annotation_key,
    build_spec,
    is_device_name,
    minimum_version,
    validate_spec,
    write_spec,
)
from kxpu.model import ContainerEdits, DeviceNode, Mount


@pytest.mark.parametrize(
    "kind", ["example.com/npu", "nvidia.com/gpu", "vendor.io/mig-1g.10gb", "a/b", "k8s.x-y/c_d"]
)
def test_valid_kinds(kind: str) -> None:
    assert validate_kind(kind) == kind


@pytest.mark.parametrize(
    "kind",
    ["example.com", "/npu", "example.com/", "1vendor.com/x", "example.com/3d", "v/c-", "v/c/d", "v e/c"],
)
def test_invalid_kinds(kind: str) -> None:
    with pytest.raises(ValueError, match="CDI kind"):
        validate_kind(kind)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("gpu0", True),
        ("0", True),
        ("GPU-1a::3", True),
        ("0:1", True),
        ("sim-", False),
        ("-a", False),
        ("a/b", False),
        ("", False),
    ],
)
def test_device_names(name: str, ok: bool) -> None:
    assert is_device_name(name) is ok


def test_minimum_version_follows_the_features_used() -> None:
    plain = build_spec("example.com/npu", [("npu0", ContainerEdits(env={"A": "1"}))])
    assert plain["cdiVersion"] == "0.3.0"
    host_path = build_spec(
        "example.com/npu", [("npu0", ContainerEdits(device_nodes=[DeviceNode("/dev/x", "/host/dev/x")]))]
    )
    assert host_path["cdiVersion"] == "0.5.0"
    same_path = build_spec(
        "example.com/npu", [("npu0", ContainerEdits(device_nodes=[DeviceNode("/dev/x", "/dev/x")]))]
    )
    assert (
        same_path["cdiVersion"] == "0.3.0"
        and "hostPath" not in same_path["devices"][0]["containerEdits"]["deviceNodes"][0]
    )
    assert build_spec("example.com/npu", [("0", ContainerEdits(env={"A": "1"}))])["cdiVersion"] == "0.5.0"
    assert (
        build_spec("nvidia.com/mig-1g.10gb", [("m0", ContainerEdits(env={"A": "1"}))])["cdiVersion"]
        == "0.6.0"
    )
    assert minimum_version({"kind": "a/b", "devices": [], "annotations": {"x": "y"}}) == "0.6.0"


def test_edits_map_to_cdi_fields() -> None:
    edits = ContainerEdits(
        env={"A": "1", "B": "x=y"},
        mounts=[
            Mount("/opt/lib", "/usr/lib/vendor", read_only=True),
            Mount("/scratch", "/data", read_only=False),
        ],
        device_nodes=[DeviceNode("/dev/npu0", "/dev/npu0", "rw")],
    )
    spec = build_spec("example.com/npu", [("npu0", edits)])
    assert validate_spec(spec) == []
    assert spec["devices"][0] == {
        "name": "npu0",
        "containerEdits": {
            "env": ["A=1", "B=x=y"],
            "deviceNodes": [{"path": "/dev/npu0", "permissions": "rw"}],
            "mounts": [
                {"hostPath": "/usr/lib/vendor", "containerPath": "/opt/lib", "options": ["ro", "bind"]},
                {"hostPath": "/data", "containerPath": "/scratch", "options": ["rw", "bind"]},
            ],
        },
    }


def test_validation_finds_what_runtimes_refuse() -> None:
    assert "a spec needs at least one device" in validate_spec(
        {"cdiVersion": "0.3.0", "kind": "a.com/b", "devices": []}
    )
    errors = validate_spec(
        {
            "cdiVersion": "0.3.0",
            "kind": "a.com/b",
            "devices": [
                {"name": "x", "containerEdits": {}},
                {
                    "name": "x",
                    "containerEdits": {"env": ["NOEQUALS"], "deviceNodes": [{"hostPath": "/dev/a"}]},
                },
                {
                    "name": "y-",
                    "containerEdits": {
                        "mounts": [{"hostPath": "/a"}],
                        "deviceNodes": [{"path": "/dev/b", "hostPath": "/h", "permissions": "rwx"}],
                    },
                },
            ],
            "extra": 1,
        }
    )
    text = "\n".join(errors)
    for fragment in (
        "must not be empty",
        "device name repeated",
        "not K=V",
        "device node without a path",
        "not a valid CDI device name",
        "needs hostPath and containerPath",
        "not a mix of r, w, m",
        "older than the content needs (0.5.0)",
        "unknown top-level field 'extra'",
    ):
        assert fragment in text, fragment
    assert any(
        "is not a released CDI version" in e
        for e in validate_spec(
            {
                "cdiVersion": "9.9",
                "kind": "a.com/b",
                "devices": [{"name": "a", "containerEdits": {"env": ["A=1"]}}],
            }
        )
    )


def test_annotation_keys_are_valid_kubernetes_annotation_names() -> None:
    assert annotation_key("kxpu", "example.com/npu") == "cdi.k8s.io/kxpu_example.com_npu"
    long_key = annotation_key("kxpu", "a-very-long-vendor-domain.example.com/" + "x" * 80)
    name = long_key.removeprefix("cdi.k8s.io/")
    assert len(name) <= 63 and name[0].isalnum() and name[-1].isalnum()
    assert annotation_key("kxpu", "a-very-long-vendor-domain.example.com/" + "y" * 80) != long_key


def test_write_spec_is_atomic_json_named_after_the_kind(tmp_path: Path) -> None:
    spec = build_spec("example.com/npu", [("npu0", ContainerEdits(env={"A": "1"}))])
    path = write_spec(tmp_path / "cdi", spec)
    assert path.name == "kxpu-example.com-npu.json"  # the CDI spec file, not the socket
    assert json.loads(path.read_text()) == spec
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
