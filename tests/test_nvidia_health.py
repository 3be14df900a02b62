"""Health from NVML events: critical and ignored Xids, env overrides, MIG matching, failures, recovery."""

from __future__ import annotations

import time

import pytest

from kxpu.backends.nvidia.health import XidPolicy
from kxpu.testing.fake_nvml import FakeNvml
from tests.nvidia_support import make, next_list, unhealthy
from tests.waiting import wait_until


async def test_critical_xid_marks_that_gpu_unhealthy_within_milliseconds() -> None:
    backend, fake = make("a100-8x")
    updates = backend.watch()
    first = await next_list(updates)
    assert not unhealthy(first)
    started = time.perf_counter()
    fake.inject_xid(3, 79)
    changed = await next_list(updates, lambda ds: bool(unhealthy(ds)))
    latency = time.perf_counter() - started
    assert unhealthy(changed) == {fake.gpus[3].uuid}
    assert next(d for d in changed if not d.healthy).health_reason == "xid-79"
    assert latency < 0.1, f"Xid to watch() took {latency * 1000:.1f} ms"
    await updates.aclose()
    backend.close()


async def test_application_xids_are_ignored_by_default() -> None:
    backend, fake = make("a100-8x")
    updates = backend.watch()
    await next_list(updates)
    for xid in (13, 31, 43, 45, 68, 109):
        fake.inject_xid(0, xid)
    fake.inject_xid(1, 48)  # events are handled in order: once GPU 1 flips, GPU 0's were seen and ignored
    changed = await next_list(updates, lambda ds: bool(unhealthy(ds)))
    assert unhealthy(changed) == {fake.gpus[1].uuid}
    await updates.aclose()
    backend.close()


async def test_configured_ignored_xids_replace_the_default() -> None:
    backend, fake = make("a100-8x", health={"ignoredXids": [79]})
    updates = backend.watch()
    await next_list(updates)
    fake.inject_xid(0, 79)
    fake.inject_xid(1, 13)
    changed = await next_list(updates, lambda ds: bool(unhealthy(ds)))
    assert unhealthy(changed) == {fake.gpus[1].uuid}
    await updates.aclose()
    backend.close()


@pytest.mark.parametrize(
    ("disable", "enable", "xid", "acted_on"),
    [
        ("", "", 13, False),
        ("", "", 79, True),
        ("79", "", 79, False),
        ("48, 79", "", 48, False),
        ("xids", "", 79, False),
        ("all", "79", 79, True),
        ("all", "79", 48, False),
        ("", "13", 13, True),
        ("", "all", 13, True),
        ("garbage,79", "", 79, False),
    ],
)
def test_dp_healthcheck_env_vars_as_nvidia_reads_them(
    disable: str, enable: str, xid: int, acted_on: bool
) -> None:
    policy = XidPolicy.from_env(
        (13, 31, 43, 45, 68, 109), {"DP_DISABLE_HEALTHCHECKS": disable, "DP_ENABLE_HEALTHCHECKS": enable}
    )
    assert policy.ignores(xid) is not acted_on


async def test_dp_disable_healthchecks_all_creates_no_event_set() -> None:
    backend, fake = make("a100-8x", environ={"DP_DISABLE_HEALTHCHECKS": "all"})
    assert backend.monitor is None
    updates = backend.watch()
    await next_list(updates)
    assert fake.inject_xid(0, 79) == 0  # nobody registered for events
    await updates.aclose()
    backend.close()


async def test_mig_events_are_matched_to_their_gpu_and_compute_instance() -> None:
    fake = FakeNvml("h100-mig-mixed")
    backend, _ = make(fake, migStrategy="mixed", migProfile="1g.10gb")
    updates = backend.watch()
    devices = await next_list(updates)
    target = fake.gpus[0].migs[3]  # the second 1g.10gb
    other_profile = fake.gpus[0].migs[0]  # a 3g.40gb another resource serves
    fake.inject_xid(0, 79, gi=other_profile.gi, ci=other_profile.ci)
    fake.inject_xid(0, 79, gi=target.gi, ci=target.ci)
    changed = await next_list(updates, lambda ds: bool(unhealthy(ds)))
    assert unhealthy(changed) == {target.uuid}
    assert len(devices) == 2
    # A GPU-wide event takes down every MIG device on it.
    fake.inject_xid(0, 79)
    changed = await next_list(updates, lambda ds: len(unhealthy(ds)) == 2)
    await updates.aclose()
    backend.close()


async def test_double_bit_ecc_error_marks_the_gpu_unhealthy() -> None:
    backend, fake = make("a100-8x")
    updates = backend.watch()
    await next_list(updates)
    fake.inject_double_bit_ecc(5)
    changed = await next_list(updates, lambda ds: bool(unhealthy(ds)))
    assert unhealthy(changed) == {fake.gpus[5].uuid}
    assert next(d for d in changed if not d.healthy).health_reason == "ecc-double-bit"
    await updates.aclose()
    backend.close()


async def test_failing_event_wait_marks_every_gpu_unhealthy() -> None:
    backend, fake = make("a100-8x")
    updates = backend.watch()
    await next_list(updates)
    fake.fail_event_wait(fake.NVML_ERROR_UNKNOWN)
    changed = await next_list(updates, lambda ds: bool(unhealthy(ds)))
    assert len(unhealthy(changed)) == 8
    assert {d.health_reason for d in changed} == {"nvml-event-wait-failed"}
    await updates.aclose()
    backend.close()


async def test_gpu_falling_off_the_bus_is_unhealthy_at_once_via_its_xid() -> None:
    backend, fake = make("a100-8x")
    updates = backend.watch()
    await next_list(updates)
    fake.lose_gpu(2)
    changed = await next_list(updates, lambda ds: bool(unhealthy(ds)))
    assert unhealthy(changed) == {fake.gpus[2].uuid}
    await updates.aclose()
    backend.close()


async def test_gpu_lost_without_an_event_is_found_by_the_probe_at_the_wait_timeout() -> None:
    backend, fake = make("a100-8x", event_wait_ms=100)
    updates = backend.watch()
    await next_list(updates)
    fake.lose_gpu(6, xid=None)
    changed = await next_list(updates, lambda ds: bool(unhealthy(ds)), timeout=5)
    assert unhealthy(changed) == {fake.gpus[6].uuid}
    assert next(d for d in changed if not d.healthy).health_reason == "gpu-lost"
    await updates.aclose()
    backend.close()


async def test_xid_fault_recovers_after_a_quiet_period_of_good_probes() -> None:
    backend, fake = make("a100-8x", health={"recovery": {"enabled": True, "quietPeriodSeconds": 0.3}})
    updates = backend.watch()
    await next_list(updates)
    fake.inject_xid(4, 79)
    bad = await next_list(updates, lambda ds: bool(unhealthy(ds)))
    marked = time.monotonic()
    assert unhealthy(bad) == {fake.gpus[4].uuid}
    fake.inject_xid(4, 79)  # a repeat restarts the quiet period
    good = await next_list(updates, lambda ds: not unhealthy(ds), timeout=5)
    assert good and time.monotonic() - marked >= 0.3
    await updates.aclose()
    backend.close()


async def test_no_recovery_while_the_gpu_fails_probes() -> None:
    backend, fake = make("a100-8x", health={"recovery": {"enabled": True, "quietPeriodSeconds": 0.2}})
    updates = backend.watch()
    await next_list(updates)
    fake.lose_gpu(1)
    await next_list(updates, lambda ds: bool(unhealthy(ds)))
    # GPU 7 gets a plain Xid: it recovers while the lost GPU 1 stays down.
    fake.inject_xid(7, 79)
    await next_list(updates, lambda ds: fake.gpus[7].uuid in unhealthy(ds))
    after = await next_list(updates, lambda ds: fake.gpus[7].uuid not in unhealthy(ds), timeout=5)
    assert unhealthy(after) == {fake.gpus[1].uuid}
    # Once it answers again, it comes back too.
    fake.restore_gpu(1)
    await next_list(updates, lambda ds: not unhealthy(ds), timeout=5)
    await updates.aclose()
    backend.close()


async def test_without_recovery_an_unhealthy_gpu_stays_unhealthy() -> None:
    backend, fake = make("a100-8x", event_wait_ms=50)
    updates = backend.watch()
    await next_list(updates)
    fake.inject_xid(0, 79)
    await next_list(updates, lambda ds: bool(unhealthy(ds)))
    waits = fake.calls["nvmlEventSetWait"]
    await wait_until(lambda: fake.calls["nvmlEventSetWait"] >= waits + 5, what="five quiet wait timeouts")
    assert unhealthy(backend.discover()) == {fake.gpus[0].uuid}
    await updates.aclose()
    backend.close()


async def test_close_shuts_nvml_down_once_the_health_thread_ends() -> None:
    backend, fake = make("a100-8x", event_wait_ms=50)
    updates = backend.watch()
    await next_list(updates)
    await updates.aclose()
    backend.close()
    await wait_until(lambda: not fake.initialized, what="NVML shutdown")
    assert not fake.initialized
    assert backend.monitor is not None and not backend.monitor.running
