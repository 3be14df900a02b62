"""A resource whose backend fails while serving, on the real cluster: it is retried and serves again, through the
device plugin (the node's allocatable comes back, a new pod gets a device) and through DRA with a claim
prepared (the running pod is left alone, the kubelet unprepares the deleted pod's claim, the scheduler allocates
a new claim from the slices published again). The failing backend is the repository's test backend
``breaking`` (tests/flaky_backend.py), loaded with ``--import``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from e2e import dra, kube
from e2e.conftest import E2E

NPU = "example.com/npu"
DRIVER = "npu.example.com"
CDI_DIR = Path("/var/run/cdi")
TEST_BACKENDS = ["tests.flaky_backend"]
REPORT = 'echo "BREAKING=$BREAKING"\necho end-of-report'


def breaking(tmp: Path) -> dict[str, Any]:
    """Four devices (``brk-0..3``) through DRA; the watch fails while ``tmp/break`` exists (on every retry too),
    adding a line to ``tmp/failures`` each time it fails."""
    return {
        "name": NPU,
        "breaking": {"breakWhen": str(tmp / "break"), "marker": str(tmp / "failures"), "count": 4},
        "serve": "dra",
    }


def failures(tmp: Path) -> int:
    try:
        return (tmp / "failures").read_text().count("failing")
    except FileNotFoundError:
        return 0


def visible(log: str) -> list[str]:
    match = re.search(r"^BREAKING=(.*)$", log, re.M)
    assert match, log
    return sorted(filter(None, match.group(1).split(",")))


def test_a_failed_watch_is_retried_through_the_device_plugin(e2e: E2E, tmp_path: Path) -> None:
    """On Python 3.11 and 3.12 the failure was taken for a stop: the resource stayed stopped, its allocatable 0."""
    broken = "example.com/broken"
    resource = {
        "name": broken,
        "breaking": {"breakWhen": str(tmp_path / "break"), "marker": str(tmp_path / "failures")},
    }
    daemon = e2e.kxpu([resource], imports=TEST_BACKENDS)
    kube.wait_resource(e2e.cluster, broken, allocatable=2, capacity=2, timeout=60)
    (tmp_path / "break").touch()
    kube.wait_until("the backend to fail", lambda: failures(tmp_path) > 0 or None, timeout=30, interval=0.05)
    (tmp_path / "break").unlink()
    kube.wait_until(
        "kxpu to register the resource again",
        lambda: daemon.log_text().count("registered with the kubelet") >= 2 or None,
        timeout=60,
    )
    kube.wait_resource(e2e.cluster, broken, allocatable=2, capacity=2, timeout=60)
    pod = e2e.pod("after-failure", REPORT, {broken: 1})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    assert len(visible(kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report"))) == 1


def test_a_failed_watch_with_a_prepared_claim_recovers(e2e: E2E, tmp_path: Path) -> None:
    dra.forget_driver(e2e, DRIVER)
    daemon = e2e.kxpu([breaking(tmp_path)], imports=TEST_BACKENDS)
    kube.wait_until(
        "kxpu's ResourceSlices", lambda: len(dra.pool_devices(e2e.cluster, DRIVER)) == 4 or None, timeout=60
    )
    cls = dra.device_class(e2e, "kxpu-brk", DRIVER)
    template = dra.claim_template(e2e, "one", [{"name": "npu", "exactly": dra.exactly(cls, 1)}])
    first = dra.claim_pod(e2e, "first", REPORT, template)
    kube.wait_pod_phase(e2e.cluster, first.name, "Running")
    before = kube.container_state(kube.get_pod(e2e.cluster, first.name))
    first_claim = dra.pod_claim(e2e.cluster, first.name)
    first_devices = visible(kube.wait_pod_log(e2e.cluster, first.name, "end-of-report"))
    spec = CDI_DIR / f"kxpu-dra-{DRIVER}-{first_claim['metadata']['uid']}.json"
    assert spec.exists()

    # The backend fails while the claim is prepared; it is fixed a moment later (the first retry is 0.5 s on).
    (tmp_path / "break").touch()
    kube.wait_until("the backend to fail", lambda: failures(tmp_path) > 0 or None, timeout=30, interval=0.05)
    (tmp_path / "break").unlink()
    kube.wait_until(
        "kxpu to serve the resource again",
        lambda: daemon.log_text().count("registered with the kubelet") >= 2 or None,
        timeout=60,
    )
    assert daemon.alive()
    assert kube.container_state(kube.get_pod(e2e.cluster, first.name)) == before, (
        "the running pod was disturbed"
    )
    assert spec.exists(), "a backend failure must not touch a prepared claim"

    # The deleted pod's claim is unprepared (the pod is gone, its CDI spec too) ...
    e2e.cluster.kubectl("delete", "pod", first.name, "--wait=true", "--timeout=60s")
    kube.wait_until("the first claim unprepared", lambda: not spec.exists() or None, 60)
    # ... and a new claim is allocated from the slices published again, and prepared.
    kube.wait_until(
        "the pool published", lambda: len(dra.pool_devices(e2e.cluster, DRIVER)) == 4 or None, timeout=60
    )
    second = dra.claim_pod(e2e, "second", REPORT, template)
    kube.wait_pod_phase(e2e.cluster, second.name, "Running", timeout=120)
    assert len(visible(kube.wait_pod_log(e2e.cluster, second.name, "end-of-report"))) == 1
    assert first_devices and len(first_devices) == 1
