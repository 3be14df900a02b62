"""Device metadata files in the container (KEP-5304): the file, the CDI spec that mounts it, the CDI device in the
prepare answer, their removal; paths and format as k8s.io/dynamic-resource-allocation/api/metadata (1.37)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.cdi.spec import validate_spec
from kxpu.dra.checkpoint import Checkpoint
from kxpu.dra.metadata import MetadataWriter
from kxpu.dra.prepare import Preparer
from kxpu.dra.slices import device_attributes
from kxpu.model import index_by_id
from kxpu.testing.dra import FakeDraApi

DRIVER = "npu.example.com"
NODE = "node-a"
IN_CONTAINER = "/var/run/kubernetes.io/dra-device-attributes"


def result(device: str, request: str = "npu") -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device}


class Rig:
    def __init__(self, root: Path, metadata: bool = True) -> None:
        self.root = root
        self.backend = SimulatedBackend(
            SimulatedConfig(count=4, model="sim", env={"NPU_VISIBLE_DEVICES": "{ids}"})
        )
        self.devices = index_by_id(self.backend.discover())
        self.api = FakeDraApi()
        self.cdi = root / "cdi"
        self.plugin_dir = root / "plugins" / DRIVER
        self.metadata = metadata
        self.preparer = self.make()

    def make(self) -> Preparer:
        checkpoint = Checkpoint(self.plugin_dir / "checkpoint.json", DRIVER)
        checkpoint.load()
        preparer = Preparer(DRIVER, NODE, self.backend, self.devices, checkpoint, self.cdi, self.api)
        preparer.metadata_dir = self.plugin_dir
        if self.metadata:
            preparer.metadata = MetadataWriter(DRIVER, self.plugin_dir, self.cdi)
        return preparer

    def host_file(self, claim: str, request: str) -> Path:
        return self.plugin_dir / "dra-device-metadata" / f"default_{claim}" / request / "metadata.json"


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def stream(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_each_request_gets_a_file_mounted_by_a_cdi_device_on_its_first_device(rig: Rig) -> None:
    claim = rig.api.add_claim("c", [result("sim-0"), result("sim-1"), result("sim-2", request="other")])
    answer = (await rig.preparer.prepare([claim]))[claim.uid]
    assert answer.error is None
    meta = f"{DRIVER}/metadata"
    assert [d.cdi_device_ids for d in answer.devices] == [
        (f"{DRIVER}/claim={claim.uid}-npu", f"{meta}={claim.uid}_npu"),
        (),
        (f"{DRIVER}/claim={claim.uid}-other", f"{meta}={claim.uid}_other"),
    ]
    spec = json.loads((rig.cdi / f"{DRIVER}_metadata_{claim.uid}_npu.json").read_text())
    assert validate_spec(spec) == [] and spec["kind"] == meta
    (device,) = spec["devices"]
    assert device["name"] == f"{claim.uid}_npu"
    assert device["containerEdits"]["mounts"] == [
        {
            "hostPath": str(rig.host_file("c", "npu")),
            "containerPath": f"{IN_CONTAINER}/resourceclaims/c/npu/{DRIVER}-metadata.json",
            "options": ["ro", "bind"],
        }
    ]
    # The same object once per version, newest first; the devices with the attributes the slice publishes.
    beta, alpha = stream(rig.host_file("c", "npu"))
    assert beta["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    assert alpha["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
    assert {k: v for k, v in alpha.items() if k != "apiVersion"} == {
        k: v for k, v in beta.items() if k != "apiVersion"
    }
    assert beta["kind"] == "DeviceMetadata"
    assert beta["metadata"] == {"name": "c", "namespace": "default", "uid": claim.uid, "generation": 1}
    assert "podClaimName" not in beta
    (request,) = beta["requests"]
    assert request["name"] == "npu"
    assert request["devices"] == [
        {
            "driver": DRIVER,
            "pool": NODE,
            "name": f"sim-{i}",
            "attributes": device_attributes(rig.devices[f"sim-{i}"]),
        }
        for i in (0, 1)
    ]
    assert request["devices"][0]["attributes"]["uuid"] == {"string": rig.devices["sim-0"].uuid}

    # A restarted driver answers the kubelet's repeated prepare the same; unprepare removes it all.
    again = (await rig.make().prepare([claim]))[claim.uid]
    assert again == answer
    assert await rig.make().unprepare([claim]) == {claim.uid: None}
    assert not list(rig.cdi.glob("*.json"))
    assert not (rig.plugin_dir / "dra-device-metadata" / "default_c").exists()


async def test_a_template_claim_is_found_by_its_pod_claim_name_and_a_subrequest_by_its_request(
    rig: Rig,
) -> None:
    claim = rig.api.add_claim("pod-x-gpus-7f2kq", [result("sim-3", request="npu/big")])
    obj = rig.api.claims[("default", claim.name)]
    obj["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpus"}
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
    spec = json.loads((rig.cdi / f"{DRIVER}_metadata_{claim.uid}_npu.json").read_text())
    (mount,) = spec["devices"][0]["containerEdits"]["mounts"]
    assert mount["containerPath"] == f"{IN_CONTAINER}/resourceclaimtemplates/gpus/npu/{DRIVER}-metadata.json"
    beta, _ = stream(Path(mount["hostPath"]))
    assert beta["podClaimName"] == "gpus"
    assert beta["requests"][0]["name"] == "npu/big"  # the subrequest chosen, in the content


async def test_off_by_default_and_a_claim_prepared_with_it_is_still_cleaned_after_it_is_turned_off(
    tmp_path: Path,
) -> None:
    on = Rig(tmp_path)
    claim = on.api.add_claim("c", [result("sim-0")])
    assert (await on.preparer.prepare([claim]))[claim.uid].error is None
    off = Rig(tmp_path, metadata=False)
    off.api = on.api
    plain = off.api.add_claim("d", [result("sim-1")])
    answer = (await off.make().prepare([plain]))[plain.uid]
    assert answer.devices[0].cdi_device_ids == (f"{DRIVER}/claim={plain.uid}-npu",)
    assert await off.make().unprepare([claim, plain]) == {claim.uid: None, plain.uid: None}
    assert not list(on.cdi.glob("*.json"))
    assert not on.host_file("c", "npu").exists()


async def test_files_that_cannot_be_written_leave_the_claim_prepared_without_them(rig: Rig) -> None:
    rig.plugin_dir.mkdir(parents=True)
    (rig.plugin_dir / "dra-device-metadata").write_text("not a directory")
    claim = rig.api.add_claim("c", [result("sim-0")])
    answer = (await rig.preparer.prepare([claim]))[claim.uid]
    assert answer.error is None
    assert answer.devices[0].cdi_device_ids == (f"{DRIVER}/claim={claim.uid}-npu",)
    assert not list(rig.cdi.glob(f"{DRIVER}_metadata_*"))


async def test_a_claim_of_the_same_name_keeps_its_files_when_the_old_one_goes(rig: Rig) -> None:
    old = rig.api.add_claim("c", [result("sim-0")])
    assert (await rig.preparer.prepare([old]))[old.uid].error is None
    # Deleted and made again under the same name, for a new pod, while the old pod is still going away.
    new = rig.api.add_claim("c", [result("sim-1")])
    assert (await rig.preparer.prepare([new]))[new.uid].error is None
    assert await rig.preparer.unprepare([old]) == {old.uid: None}
    assert stream(rig.host_file("c", "npu"))[0]["metadata"]["uid"] == new.uid
    assert (rig.cdi / f"{DRIVER}_metadata_{new.uid}_npu.json").exists()
    assert not (rig.cdi / f"{DRIVER}_metadata_{old.uid}_npu.json").exists()


async def test_orphans_a_crash_left_are_removed_at_start(rig: Rig) -> None:
    claim = rig.api.add_claim("c", [result("sim-0")])
    writer = MetadataWriter(DRIVER, rig.plugin_dir, rig.cdi)
    writer.write("default", "c", claim.uid, None, [])  # nothing: no file
    from kxpu.dra.metadata import MetadataDevice

    ids = writer.write("default", "c", claim.uid, None, [MetadataDevice("npu", NODE, "sim-0", {})])
    assert ids == {"npu": f"{DRIVER}/metadata={claim.uid}_npu"}
    spec = rig.cdi / f"{DRIVER}_metadata_{claim.uid}_npu.json"
    other_driver = rig.cdi / f"x.{DRIVER}_metadata_{claim.uid}_npu.json"
    other_driver.write_text("{}")
    assert rig.make().remove_orphan_specs() == [spec]
    assert not spec.exists() and not rig.host_file("c", "npu").exists() and other_driver.exists()


async def test_a_template_claim_from_the_claim_cache_keeps_its_pod_claim_name(rig: Rig) -> None:
    """The node's claim cache keeps only what prepare reads: the pod claim name is part of that now (before, the
    file of a template claim was mounted under resourceclaims/<generated name>, where no pod looks)."""
    from kxpu.dra.claim_cache import trim

    claim = rig.api.add_claim("pod-x-devices-9abcd", [result("sim-0")])
    obj = rig.api.claims[("default", claim.name)]
    obj["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "devices", "other": "x"}
    trimmed = trim(obj, DRIVER, NODE)
    assert trimmed is not None
    assert trimmed["metadata"]["annotations"] == {"resource.kubernetes.io/pod-claim-name": "devices"}
    rig.api.claims[("default", claim.name)] = trimmed  # prepare reads what the cache would hand it
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
    spec = json.loads((rig.cdi / f"{DRIVER}_metadata_{claim.uid}_npu.json").read_text())
    (mount,) = spec["devices"][0]["containerEdits"]["mounts"]
    assert (
        mount["containerPath"] == f"{IN_CONTAINER}/resourceclaimtemplates/devices/npu/{DRIVER}-metadata.json"
    )


async def test_a_hand_made_pod_claim_name_cannot_move_the_mount(rig: Rig) -> None:
    """Anyone may write a claim with the annotation the resourceclaim controller sets: a value that is not a DNS
    label (a pod claim name is one) is ignored, the file mounted under resourceclaims/<claim>."""
    claim = rig.api.add_claim("c", [result("sim-0")])
    rig.api.claims[("default", "c")]["metadata"]["annotations"] = {
        "resource.kubernetes.io/pod-claim-name": "../../../../etc/x"
    }
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
    spec = json.loads((rig.cdi / f"{DRIVER}_metadata_{claim.uid}_npu.json").read_text())
    (mount,) = spec["devices"][0]["containerEdits"]["mounts"]
    assert mount["containerPath"] == f"{IN_CONTAINER}/resourceclaims/c/npu/{DRIVER}-metadata.json"


async def test_an_orphan_spec_pointing_outside_the_metadata_directory_removes_nothing_there(
    rig: Rig, tmp_path: Path
) -> None:
    outside = tmp_path / "precious" / "dir"
    outside.mkdir(parents=True)
    (outside / "metadata.json").write_text("{}")
    writer = MetadataWriter(DRIVER, rig.plugin_dir, rig.cdi)
    writer.root.mkdir(parents=True)  # the kernel walks '..' only through directories that exist
    sneaky = writer.root / ".." / ".." / ".." / "precious" / "dir" / "metadata.json"
    assert sneaky.resolve() == (outside / "metadata.json").resolve()
    spec = rig.cdi / f"{DRIVER}_metadata_0000_npu.json"
    rig.cdi.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"devices": [{"containerEdits": {"mounts": [{"hostPath": str(sneaky)}]}}]}))
    writer.remove_orphan(spec)
    assert not spec.exists()
    assert (outside / "metadata.json").exists()
