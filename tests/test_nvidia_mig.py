"""MIG strategies: none, single (uniform layouts only), mixed (one MIG profile per kxpu resource)."""

from __future__ import annotations

import pytest

from kxpu.config import ConfigError, parse_config
from kxpu.model import BackendError
from tests.nvidia_support import make


def test_none_serves_whole_gpus_even_with_mig_on() -> None:
    backend, fake = make("h100-mig-mixed", migStrategy="none")
    assert [d.id for d in backend.discover()] == [g.uuid for g in fake.gpus]
    backend.close()


def test_mixed_without_profile_serves_the_gpus_whose_mig_is_off() -> None:
    backend, fake = make("h100-mig-mixed", migStrategy="mixed")
    assert [d.id for d in backend.discover()] == [fake.gpus[1].uuid]
    backend.close()


def test_mixed_with_profile_serves_that_profiles_mig_devices_with_their_facts() -> None:
    backend, fake = make("h100-mig-mixed", migStrategy="mixed", migProfile="1g.10gb")
    devices = backend.discover()
    migs = [m for m in fake.gpus[0].migs if m.gi_slices == 1]
    assert [d.id for d in devices] == [m.uuid for m in migs]
    first = devices[0]
    assert first.memory_mib == 9856
    assert first.extra["migProfile"] == "1g.10gb"
    assert (first.extra["gpuInstance"], first.extra["computeInstance"]) == (migs[0].gi, migs[0].ci)
    assert first.extra["parentUuid"] == fake.gpus[0].uuid
    assert first.model == "NVIDIA H100 80GB HBM3"
    edits = backend.allocate(devices)
    assert edits.env == {"NVIDIA_VISIBLE_DEVICES": ",".join(m.uuid for m in migs)}
    backend.close()


def test_mixed_mig_index_ids_are_gpu_colon_slot() -> None:
    backend, _ = make("h100-mig-mixed", migStrategy="mixed", migProfile="1g.10gb", deviceIDStrategy="index")
    assert [d.id for d in backend.discover()] == ["0:2", "0:3"]
    backend.close()


def test_single_with_uniform_layout_serves_every_mig_device() -> None:
    backend, _ = make("h100-mig-single", migStrategy="single")
    devices = backend.discover()
    assert len(devices) == 14
    assert {d.extra["migProfile"] for d in devices} == {"1g.10gb"}
    backend.close()


def test_single_refuses_gpus_with_different_mig_modes() -> None:
    with pytest.raises(BackendError, match="MIG is off on GPU 1"):
        make("h100-mig-mixed", migStrategy="single")


def test_single_refuses_more_than_one_mig_device_type() -> None:
    from kxpu.testing.fake_nvml import FakeNvml

    fake = FakeNvml("h100-mig-mixed")
    fake.gpus.pop()  # every GPU has MIG on now, but the layout still mixes profiles
    with pytest.raises(BackendError, match=r"one MIG device type.*1g\.10gb, 2g\.20gb, 3g\.40gb"):
        make(fake, migStrategy="single")
    assert not fake.initialized  # a failed build releases NVML


def test_single_without_any_mig_gpu_falls_back_to_whole_gpus() -> None:
    backend, _ = make("a100-8x", migStrategy="single")
    assert len(backend.discover()) == 8
    backend.close()


@pytest.mark.parametrize("strategy", ["single", "mixed"])
def test_mig_enabled_without_mig_devices_is_an_invalid_configuration(strategy: str) -> None:
    with pytest.raises(
        BackendError, match="invalid MIG configuration: GPU 0 has MIG enabled but no MIG devices"
    ):
        make("h100-mig-empty", migStrategy=strategy)


def test_mig_profile_needs_mixed_and_a_profile_shaped_name() -> None:
    with pytest.raises(ConfigError, match="set migStrategy: mixed"):
        parse_config(
            {
                "version": "v1",
                "resources": [{"name": "nvidia.com/mig-1g.10gb", "nvidia": {"migProfile": "1g.10gb"}}],
            }
        )
    with pytest.raises(ConfigError, match="not a MIG profile name"):
        parse_config(
            {
                "version": "v1",
                "resources": [
                    {"name": "nvidia.com/mig", "nvidia": {"migStrategy": "mixed", "migProfile": "big"}}
                ],
            }
        )


def test_mixed_node_split_over_two_kxpu_resources_covers_every_device_once() -> None:
    whole, fake = make("h100-mig-mixed", migStrategy="mixed")
    ids = {d.id for d in whole.discover()}
    for profile in ("1g.10gb", "2g.20gb", "3g.40gb"):
        backend, _ = make(fake, migStrategy="mixed", migProfile=profile)
        found = {d.id for d in backend.discover()}
        assert not ids & found
        ids |= found
        backend.close()
    assert ids == {fake.gpus[1].uuid} | {m.uuid for m in fake.gpus[0].migs}
    whole.close()
