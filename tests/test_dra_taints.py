"""Device taints per fault class (KEP-5055): which key a backend's reason gets, the effect ``dra.taints`` gives it,
the taint lifted on recovery, withdrawal per effect, and prepare admitting what the scheduler may allocate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kxpu.config import parse_config
from kxpu.dra.config import DraConfig
from kxpu.dra.publisher import SlicePublisher
from kxpu.dra.slices import device_entry, pool_content
from kxpu.dra.taints import TAINT_KEYS, TaintPolicy, taint_value, tolerates
from kxpu.model import Device, FaultClass, Health, fault_class
from kxpu.testing.dra import ApiRefused, FakeDraApi
from tests.test_dra_prepare import DRIVER, NODE, Rig, result

LOST, ECC, UNMONITORED, DRIVER_ERROR, OTHER = (
    FaultClass.DEVICE_LOST,
    FaultClass.ECC_FATAL,
    FaultClass.UNMONITORED,
    FaultClass.DRIVER_ERROR,
    FaultClass.OTHER,
)


@pytest.mark.parametrize(
    ("reason", "cls"),
    [
        # nvidia (kxpu.backends.nvidia.health)
        ("xid-79", LOST),
        ("gpu-lost", LOST),
        ("xid-48", ECC),
        ("xid-94", ECC),
        ("xid-95", ECC),
        ("ecc-double-bit", ECC),
        ("xid-13", DRIVER_ERROR),
        ("nvml-probe-failed", DRIVER_ERROR),
        ("nvml-events-unavailable", UNMONITORED),
        ("nvml-event-wait-failed", UNMONITORED),
        ("health-thread-crashed", UNMONITORED),
        # amd
        ("ras-uncorrectable-umc", ECC),
        ("ecc-uncorrectable", ECC),
        ("amdsmi-unavailable", UNMONITORED),
        ("bad-sysfs", DRIVER_ERROR),
        ("no-kfd", DRIVER_ERROR),
        ("no-drm-device", LOST),
        ("no-device-node", LOST),
        ("no-kfd-node", LOST),
        # cambricon
        ("cndev-unavailable", UNMONITORED),
        ("cndev-in-problem", DRIVER_ERROR),
        ("cndev-18", DRIVER_ERROR),
        ("not-in-cndev", LOST),
        # ascend
        ("dcmi-unavailable", UNMONITORED),
        ("dcmi-health-2", DRIVER_ERROR),
        ("dcmi-list-failed-8005", DRIVER_ERROR),
        ("device-node-missing", LOST),
        # gaudi
        ("aip-lost", LOST),
        ("hlml-query-failed", DRIVER_ERROR),
        ("HLML unavailable (HLML_ERROR_UNINITIALIZED): is the habanalabs driver loaded?", UNMONITORED),
        # neuron
        ("hbm-uncorrectable-error", ECC),
        ("sram-uncorrectable-error", ECC),
        ("device-state-invalid", DRIVER_ERROR),
        ("sysfs-unreadable", DRIVER_ERROR),
        # anything else
        ("state-file", OTHER),
        ("", OTHER),
        (None, OTHER),
    ],
)
def test_every_backends_reasons_have_a_fault_class(reason: str | None, cls: FaultClass) -> None:
    assert fault_class(reason) is cls


def sick(reason: str, device_id: str = "gpu-0") -> Device:
    return Device(id=device_id).with_health(Health.UNHEALTHY, reason)


EFFECTS = TaintPolicy({LOST: "NoExecute", ECC: "NoSchedule", UNMONITORED: "None"})


@pytest.mark.parametrize(
    ("reason", "key", "effect"),
    [
        ("xid-79", "kxpu.io/device-lost", "NoExecute"),
        ("ecc-double-bit", "kxpu.io/ecc-fatal", "NoSchedule"),
        ("nvml-events-unavailable", "kxpu.io/unmonitored", "None"),
        ("xid-13", "kxpu.io/driver-error", "NoSchedule"),  # not named: NoSchedule, as before classes
        ("state-file", "kxpu.io/unhealthy", "NoSchedule"),
    ],
)
def test_a_fault_taints_its_device_with_its_class_key_and_configured_effect(
    reason: str, key: str, effect: str
) -> None:
    entry = device_entry(sick(reason), "taint", taints=EFFECTS)
    assert entry["taints"] == [{"key": key, "value": taint_value(reason), "effect": effect}]
    healthy = device_entry(sick(reason).with_health(Health.HEALTHY), "taint", taints=EFFECTS)
    assert "taints" not in healthy


def test_the_held_taint_stays_beside_a_fault() -> None:
    entry = device_entry(sick("xid-79"), "taint", held=True, taints=EFFECTS)
    assert [t["key"] for t in entry["taints"]] == ["kxpu.io/device-lost", "kxpu.io/held-by-device-plugin"]


def test_withdrawal_keeps_devices_whose_fault_only_informs() -> None:
    devices = [
        sick("xid-79", "lost"),
        sick("nvml-events-unavailable", "unmonitored"),
        sick("ecc-double-bit", "ecc"),
        Device(id="fine"),
    ]
    content = pool_content(DRIVER, NODE, devices, 1, "withdraw", taints=EFFECTS)
    published = content.slices[0]["devices"]
    assert [d["name"] for d in published] == ["unmonitored", "fine"]
    assert not any("taints" in d for d in published)  # withdrawal is for servers that drop taints
    tainted = pool_content(DRIVER, NODE, devices, 1, "taint", taints=EFFECTS).slices[0]["devices"]
    assert [d["name"] for d in tainted] == ["lost", "unmonitored", "ecc", "fine"]


def test_config_names_the_effect_per_class() -> None:
    config = parse_config(
        yaml.safe_load(
            """
version: v1
resources:
  - name: example.com/npu
    simulated: {count: 1}
    serve: dra
    dra:
      taints: {deviceLost: NoExecute, eccFatal: NoExecute, unmonitored: None}
"""
        )
    )
    policy = TaintPolicy(config.resources[0].dra.taints.effects())
    assert policy.fault_taint(sick("gpu-lost")) == {
        "key": "kxpu.io/device-lost",
        "value": "gpu-lost",
        "effect": "NoExecute",
    }
    assert policy.effect(UNMONITORED) == "None" and policy.effect(DRIVER_ERROR) == "NoSchedule"
    assert (
        TaintPolicy(DraConfig().taints.effects()).effect(LOST) == "NoSchedule"
    )  # the default: nothing evicted unasked
    with pytest.raises(ValidationError, match=r"deviceLost\n.*'NoSchedule', 'NoExecute' or 'None'"):
        DraConfig.model_validate({"taints": {"deviceLost": "PreferNoSchedule"}})
    with pytest.raises(ValidationError, match="xidLost"):
        DraConfig.model_validate({"taints": {"xidLost": "NoExecute"}})


async def test_a_fault_is_published_then_lifted_when_the_device_recovers() -> None:
    api = FakeDraApi(nodes={NODE: "uid-a"})
    publisher = SlicePublisher(api, DRIVER, NODE, "taint", taints=EFFECTS)
    devices = [Device(id="gpu-0"), Device(id="gpu-1")]
    await publisher.publish(devices)
    assert not any(d.get("taints") for d in api.pool(DRIVER, NODE))

    await publisher.publish([sick("xid-79", "gpu-0"), devices[1]])
    (taint,) = api.pool(DRIVER, NODE)[0]["taints"]
    assert (taint["key"], taint["value"], taint["effect"]) == ("kxpu.io/device-lost", "xid-79", "NoExecute")
    began = "2026-01-01T00:00:00Z"  # as if the fault began long ago (the fake stamps whole seconds)
    for stored in api.slices.values():
        for device in stored["spec"]["devices"]:
            for t in device.get("taints", []):
                t["timeAdded"] = began
    # The probe now says gpu-lost: the same fault (same class), so it keeps the time it began.
    await publisher.publish([sick("gpu-lost", "gpu-0"), devices[1]])
    (taint,) = api.pool(DRIVER, NODE)[0]["taints"]
    assert taint["value"] == "gpu-lost" and taint["timeAdded"] == began

    await publisher.publish(devices)  # recovered
    assert [d["name"] for d in api.pool(DRIVER, NODE)] == ["gpu-0", "gpu-1"]
    assert not any(d.get("taints") for d in api.pool(DRIVER, NODE))


async def test_the_fake_api_refuses_what_the_api_server_refuses_in_taints() -> None:
    api = FakeDraApi(nodes={NODE: "uid-a"})
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "d", "taints": [{"key": "kxpu.io/x", "effect": "PreferNoSchedule"}]}],
        },
    }
    with pytest.raises(ApiRefused, match="effect"):
        await api.create_slice(body)
    body["spec"]["devices"][0]["taints"] = [{"key": "kxpu.io/x", "effect": "None"}] * 17
    with pytest.raises(ApiRefused, match="at most 16"):
        await api.create_slice(body)


def test_tolerations_match_as_the_api_defines() -> None:
    taint = {"key": "kxpu.io/device-lost", "value": "xid-79", "effect": "NoExecute"}
    assert tolerates([{"operator": "Exists"}], taint)  # no key, Exists: every taint
    assert tolerates([{"key": "kxpu.io/device-lost", "operator": "Exists"}], taint)
    assert tolerates([{"key": "kxpu.io/device-lost", "value": "xid-79"}], taint)  # Equal is the default
    assert tolerates([{"key": "kxpu.io/device-lost", "operator": "Exists", "effect": "NoExecute"}], taint)
    assert not tolerates([{"key": "kxpu.io/device-lost", "value": "gpu-lost"}], taint)
    assert not tolerates(
        [{"key": "kxpu.io/device-lost", "operator": "Exists", "effect": "NoSchedule"}], taint
    )
    assert not tolerates([{"key": "kxpu.io/ecc-fatal", "operator": "Exists"}], taint)
    assert not tolerates([{"value": "xid-79"}], taint)  # no key with Equal matches nothing
    assert not tolerates([], taint)


async def test_prepare_admits_a_faulty_device_only_where_its_taint_lets_the_claim_have_it(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    rig.preparer.taints = EFFECTS
    rig.preparer.update_devices(
        {
            **rig.devices,
            "sim-0": rig.devices["sim-0"].with_health(Health.UNHEALTHY, "nvml-events-unavailable"),
            "sim-1": rig.devices["sim-1"].with_health(Health.UNHEALTHY, "xid-79"),
            "sim-2": rig.devices["sim-2"].with_health(Health.UNHEALTHY, "xid-79"),
        }
    )
    informational = rig.api.add_claim("none", [result("sim-0")])
    untolerated = rig.api.add_claim(
        "raced", [result("sim-1")]
    )  # allocated before the taint reached the scheduler
    toleration = {"key": TAINT_KEYS[LOST], "operator": "Exists", "effect": "NoExecute"}
    tolerated = rig.api.add_claim("diagnostics", [result("sim-2", tolerations=[toleration])])
    answers = await rig.preparer.prepare([informational, untolerated, tolerated])
    assert answers[informational.uid].error is None
    assert "unhealthy (xid-79)" in (answers[untolerated.uid].error or "")
    assert answers[tolerated.uid].error is None
