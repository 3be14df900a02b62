"""Zero-downtime ``helm upgrade`` (issue 21; docs/dra.md, "Upgrades"): the release upgraded to another image tag
while pods run, asserted from the API server, the containers and the kubelet's directories.

- node daemon (device plugin + DRA in one DaemonSet, rolled with maxSurge 1 / maxUnavailable 0): the running pods
  keep their containers; the Node's allocatable for the device-plugin resource never drops (every version of the
  Node the API server sends, watched throughout); no ResourceSlice of the DRA driver is deleted or created again
  (watched, and UID and pool generation compared); claims are prepared while the two daemon pods overlap; a claim
  the old pod prepared is unprepared by the new one from the checkpoint;
- sharing (the extender's and the webhook's Deployments roll too): every shared pod created during the upgrade is
  admitted and carries a valid signed assignment.

The "changed image" is the same archive imported under a second tag: what a user's upgrade does to the pods.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import dra, kube
from e2e import test_helm_sharing as sharing
from e2e.cluster import KUBELET_ROOT, NODE_NAME, Cluster
from e2e.configs import simulated
from e2e.conftest import E2E
from e2e.test_helm import ARCHIVE, CHART, daemon_pods, diagnostics, helm, image_ref, ready
from e2e.test_helm import pytestmark as helm_skips
from e2e.test_helm_sharing import (
    CORES,
    MEM,
    SIGNING_SECRET,
    TENANT_NS,
    VERIFY_KEYS,
    WEBHOOK,
    ServiceRoutes,
    release,  # noqa: F401  (a fixture: the chart installed with sharing on)
    wait_ready,
)
from kxpu.sharing import signing

pytestmark = helm_skips

RELEASE = "kxpu-e2e-upgrade"
NAMESPACE = "kxpu-e2e-upgrade"
DP_RES = "upgrade.kxpu.io/npu"  # served through the device plugin
DRA_RES = "upgrade.kxpu.io/dnpu"  # served through DRA
DRIVER = "dnpu.upgrade.kxpu.io"
ROLL_TIMEOUT = 240.0
CDI = Path("/var/run/cdi")  # the chart's hostPaths.cdi, where the daemon writes each claim's CDI spec
MARK = "cat /proc/sys/kernel/random/uuid > /tmp/started"  # one value per container start


class Watch:
    """``kubectl get --watch``: every version of the objects the API server sends, in order (a thread reads)."""

    def __init__(self, cluster: Cluster, *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), "get", *args, "--watch",
             "--output-watch-events", "-o", "json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder, buffer = json.JSONDecoder(), ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            buffer += line
            while buffer.strip():
                text = buffer.lstrip()
                try:
                    event, end = decoder.raw_decode(text)
                except ValueError:
                    break  # the rest of this object has not arrived yet
                self.events.append((event["type"], event["object"]))
                buffer = text[end:]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._thread.join(timeout=10)


def live(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def image(pod: dict[str, Any]) -> str:
    return str(pod["spec"]["containers"][0]["image"])


def started_mark(cluster: Cluster, pod: str) -> str:
    return cluster.kubectl("exec", pod, "--", "cat", "/tmp/started").strip()


def warnings(cluster: Cluster, pod: str, namespace: str = "default") -> list[str]:
    """The pod's Warning events but the scheduler's (a pod waits for its claim to be made and allocated) and the
    kubelet's about this cluster's missing DNS."""
    return [
        f"{e.get('reason')}: {e.get('message')}"
        for e in kube.events_for(cluster, pod, namespace)
        if e.get("type") == "Warning" and e.get("reason") not in ("FailedScheduling", "MissingClusterDNS")
    ]


@pytest.fixture
def node_release(e2e: E2E) -> Iterator[tuple[Cluster, str, str]]:
    """The chart installed with one device-plugin and one DRA resource, and the image under a second tag (the
    upgrade's); afterwards the test's pods deleted while the daemon still runs (their claims need it), then the
    release, its namespace, the driver's slices and the second tag."""
    cluster = e2e.cluster
    if shutil.which("iptables") is None:
        pytest.skip("iptables not found: the daemon's API access needs a NAT rule (there is no kube-proxy)")
    ref = image_ref(ARCHIVE)
    cluster.ctr("images", "import", str(ARCHIVE))
    repository, _, tag = ref.rpartition(":")
    next_ref = f"{repository}:{tag}-upgrade"
    cluster.ctr("images", "tag", "--force", ref, next_ref)
    routes = ServiceRoutes()  # kube-proxy's part: the daemon (DRA: slices, claims) reaches the API server
    e2e.cleanups.append(routes.close)
    routes.api_server_for_pods()
    dra_resource = simulated(count=4, name=DRA_RES)
    dra_resource["simulated"]["env"] = {"UPG_DEVICES": "{ids}"}
    config = {
        "version": "v1",
        "resources": [
            simulated(count=2, name=DP_RES),
            {**dra_resource, "serve": "dra", "dra": {"driverName": DRIVER}},
        ],
    }
    try:
        helm(
            cluster, "upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
            "--set-json", f"config={json.dumps(config)}",
        )  # fmt: skip
        yield cluster, ref, next_ref
    finally:
        try:
            kube.delete_pods(cluster, f"kxpu-e2e={e2e.label}", timeout=120)
        finally:
            helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "90s")
            cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=90s", timeout=120)
            cluster.kubectl("delete", "resourceslices", f"--field-selector=spec.driver={DRIVER}", check=False)
            cluster.ctr("images", "rm", next_ref, check=False)


def one_daemon(cluster: Cluster, ref: str) -> dict[str, Any] | None:
    """The only daemon pod, Ready and running ``ref``, once no other (terminating included) is left."""
    pods = daemon_pods(cluster, NAMESPACE, RELEASE, "app.kubernetes.io/component=plugin")
    if len(pods) == 1 and not pods[0]["metadata"].get("deletionTimestamp") and image(pods[0]) == ref:
        return pods[0] if ready(pods[0]) else None
    return None


def test_helm_upgrade_rolls_the_node_daemon_without_disturbing_pods_devices_or_slices(
    e2e: E2E, node_release: tuple[Cluster, str, str]
) -> None:
    cluster, old_ref, new_ref = node_release
    try:
        old = kube.wait_until("the daemon pod Ready", lambda: one_daemon(cluster, old_ref), 120)
    except kube.WaitTimeout as exc:
        raise AssertionError(f"{exc}\n{diagnostics(cluster, NAMESPACE, RELEASE)}") from None
    kube.wait_resource(cluster, DP_RES, allocatable=2, capacity=2)
    kube.wait_until("the driver's pool", lambda: len(dra.pool_devices(cluster, DRIVER)) == 4, 60)
    template = dra.claim_template(e2e, "upgrade-npu", [{"name": "npu", "exactly": dra.exactly(DRIVER)}])

    # Pods running across the upgrade: one with a device-plugin device, one with a DRA claim.
    dp_held = e2e.pod("dp-held", f'{MARK}\necho "SIM=$SIM_VISIBLE_DEVICES"\necho end-of-report', {DP_RES: 1})
    dra_held = dra.claim_pod(
        e2e, "dra-held", f'{MARK}\necho "UPG=$UPG_DEVICES"\necho end-of-report', template
    )
    held = {}
    for spec in (dp_held, dra_held):
        pod = kube.wait_pod_phase(cluster, spec.name, "Running")
        kube.wait_pod_log(cluster, spec.name, "end-of-report")
        held[spec.name] = (kube.container_state(pod), started_mark(cluster, spec.name))
    held_claim = dra.pod_claim(cluster, dra_held.name)
    # What the pod's start already logged (the kubelet may read the claim before the API server's node authorizer
    # knows it is this node's, and retries): only what the upgrade adds is asserted below.
    started_warnings = warnings(cluster, dra_held.name)
    slices_before = {s["metadata"]["name"]: (s["metadata"]["uid"], s["spec"]["pool"]["generation"])
                     for s in dra.slices(cluster, DRIVER)}  # fmt: skip

    kubelet_log = cluster.log_file("kubelet")
    log_from = kubelet_log.stat().st_size
    node_watch = Watch(cluster, "node", NODE_NAME)
    slice_watch = Watch(cluster, "resourceslices", f"--field-selector=spec.driver={DRIVER}")
    try:
        kube.wait_until("both watches started", lambda: node_watch.events and slice_watch.events, 30)
        new_tag = new_ref.rpartition(":")[2]
        helm(cluster, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
             "--set", f"image.tag={new_tag}")  # fmt: skip

        # Claims prepared while the DaemonSet rolls, one after another until it is done; for each, how many daemon
        # pods were running when it was created and when it had finished.
        during: list[tuple[str, int, int]] = []
        deadline = time.monotonic() + ROLL_TIMEOUT
        while one_daemon(cluster, new_ref) is None:
            assert time.monotonic() < deadline, (
                f"the DaemonSet did not roll\n{diagnostics(cluster, NAMESPACE, RELEASE)}"
            )
            before = len(live(daemon_pods(cluster, NAMESPACE, RELEASE, "app.kubernetes.io/component=plugin")))
            spec = kube.PodSpec(
                name=f"{e2e.label[:30]}-during-{len(during)}",
                script='echo "UPG=$UPG_DEVICES"\necho end-of-report',
                labels={"kxpu-e2e": e2e.label},
                claims=[{"name": "devices", "resourceClaimTemplateName": template}],
                idle=False,
            )
            e2e.pods.append(spec)
            kube.create_pod(cluster, spec)
            try:
                kube.wait_pod_phase(cluster, spec.name, "Succeeded", timeout=120)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{diagnostics(cluster, NAMESPACE, RELEASE)}") from None
            after = len(live(daemon_pods(cluster, NAMESPACE, RELEASE, "app.kubernetes.io/component=plugin")))
            during.append((spec.name, before, after))
        new = one_daemon(cluster, new_ref)
        assert new is not None
    finally:
        node_watch.close()
        slice_watch.close()

    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    # Claims were prepared while the old and the new daemon pod both ran, and every one succeeded.
    assert any(2 in (b, a) for _, b, a in during), during
    for name, _, _ in during:
        assert "UPG=sim-npu-" in kube.pod_log(cluster, name), name
        assert not warnings(cluster, name), (name, warnings(cluster, name))

    # The Node never showed fewer devices of the device-plugin resource.
    seen = [
        kube.parse_quantity(obj["status"].get("allocatable", {}).get(DP_RES, "0"))
        for _, obj in node_watch.events
    ]
    assert len(seen) > 1 and min(seen) == 2, seen
    # Sampled every 2 s, the Node could miss a short drop; the kubelet's own log cannot. The chart chose
    # devicePluginHandover alongside for this 1.37 cluster: the new daemon registered a socket of its own beside the
    # old one's, so the kubelet never lost the resource's last plugin (the line below is 1.37's, at --v=2).
    with kubelet_log.open("rb") as log:
        log.seek(log_from)
        rolled = log.read().decode(errors="replace").splitlines()
    assert any("Registered client" in line and DP_RES in line for line in rolled)
    dropped = [
        line
        for line in rolled
        if "Last device plugin for this resource disconnected" in line and DP_RES in line
    ]
    assert not dropped, dropped
    sockets = sorted(p.name for p in (KUBELET_ROOT / "device-plugins").glob("kxpu-upgrade.kxpu.io_npu*.sock"))
    assert len(sockets) == 1 and "@" in sockets[0], sockets  # the new daemon's own; the old one removed its

    # No slice deleted or created again, none changed generation: the same objects before and after.
    kinds = [(kind, obj["metadata"]["name"]) for kind, obj in slice_watch.events]
    assert not [k for k in kinds if k[0] == "DELETED"], kinds
    assert {n for kind, n in kinds if kind == "ADDED"} == set(slices_before), kinds
    after_slices = {s["metadata"]["name"]: (s["metadata"]["uid"], s["spec"]["pool"]["generation"])
                    for s in dra.slices(cluster, DRIVER)}  # fmt: skip
    assert after_slices == slices_before

    # The running pods were not touched: same container, never restarted, the same process.
    for spec in (dp_held, dra_held):
        pod = kube.get_pod(cluster, spec.name)
        assert pod["status"]["phase"] == "Running", kube.describe(pod)
        assert (kube.container_state(pod), started_mark(cluster, spec.name)) == held[spec.name]

    # The kubelet holds one registration of the driver now: the new pod's (the old one removed its sockets).
    registry = sorted(p.name for p in (KUBELET_ROOT / "plugins_registry").glob(f"{DRIVER}-*reg.sock"))
    assert registry == [f"{DRIVER}-{new['metadata']['uid']}-reg.sock"], registry

    # The new daemon serves the device plugin too: a new pod gets the free device.
    dp_after = e2e.pod("dp-after", 'echo "SIM=$SIM_VISIBLE_DEVICES"\necho end-of-report', {DP_RES: 1})
    kube.wait_pod_log(cluster, dp_after.name, "end-of-report", timeout=90)

    # The claim the old daemon prepared is unprepared by the new one, from the checkpoint: the pod goes (the
    # kubelet keeps a pod whose claims it cannot unprepare), with no warning, and nothing of the claim is left.
    uid = held_claim["metadata"]["uid"]
    checkpoint = KUBELET_ROOT / "plugins" / DRIVER / "checkpoint.json"
    assert uid in json.loads(checkpoint.read_text())["claims"]
    cluster.kubectl("delete", "pod", dra_held.name, "--wait=true", "--timeout=90s", timeout=120)
    kube.wait_until(
        "the claim gone from the checkpoint",
        lambda: uid not in json.loads(checkpoint.read_text())["claims"],
        30,
    )
    assert not list(CDI.glob(f"*{uid}*"))
    added = [w for w in warnings(cluster, dra_held.name) if w not in started_warnings]
    assert not added, added


# -- sharing ----------------------------------------------------------------------------------------------------------
class WebhookRoute:
    """kube-proxy's part for the webhook's Service, as the upgrade moves it: the API server's route (DNAT) follows
    the Service's ready, not terminating endpoints (a thread reads its EndpointSlices)."""

    def __init__(self, cluster: Cluster, routes: ServiceRoutes, service_ip: str) -> None:
        self.cluster, self.routes, self.service_ip = cluster, routes, service_ip
        self.target: str | None = None
        self.targets: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def ready_ips(self) -> list[str]:
        listing = self.cluster.kubectl_json(
            "get", "endpointslices", "-n", sharing.NAMESPACE, "-l", f"kubernetes.io/service-name={WEBHOOK}"
        )
        return sorted(
            e["addresses"][0]
            for s in listing.get("items", [])
            for e in s.get("endpoints") or []
            if e.get("conditions", {}).get("ready") and not e.get("conditions", {}).get("terminating")
        )

    def step(self) -> None:
        ips = self.ready_ips()
        if not ips or self.target in ips:
            return
        old, self.target = self.target, ips[0]
        self.routes.service_for_host(self.service_ip, self.target, 8443)  # inserted first: wins at once
        self.targets.append(self.target)
        if old is not None:
            for rule in [r for r in self.routes.rules if any(old in part for part in r)]:
                subprocess.run(
                    ["iptables", "-t", "nat", "-D", *rule], check=True, capture_output=True, timeout=30
                )
                self.routes.rules.remove(rule)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # kubectl or iptables: kept for the report, tried again
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.3)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def components_rolled(cluster: Cluster, ref: str) -> bool:
    pods = daemon_pods(cluster, sharing.NAMESPACE, sharing.RELEASE)
    counts = {"scheduler": 1, "webhook": 2, "plugin": 1}
    for component, count in counts.items():
        mine = [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        if len(mine) != count or not all(
            ready(p) and ref in [c["image"] for c in p["spec"]["containers"]] for p in mine
        ):
            return False
    return len(pods) == sum(counts.values())


def test_helm_upgrade_rolls_extender_and_webhook_admitting_every_shared_pod(
    release: tuple[Cluster, ServiceRoutes],  # noqa: F811
) -> None:
    cluster, routes = release
    wait_ready(cluster, "scheduler")
    wait_ready(cluster, "webhook", count=2)
    wait_ready(cluster, "plugin")
    ref = image_ref(ARCHIVE)
    repository, _, tag = ref.rpartition(":")
    next_ref = f"{repository}:{tag}-upgrade"
    cluster.ctr("images", "tag", "--force", ref, next_ref)
    try:
        _upgrade_admitting_every_shared_pod(cluster, routes, next_ref)
    finally:
        cluster.ctr("images", "rm", next_ref, check=False)


def _upgrade_admitting_every_shared_pod(cluster: Cluster, routes: ServiceRoutes, next_ref: str) -> None:
    service_ip = cluster.kubectl_json("get", "service", WEBHOOK, "-n", sharing.NAMESPACE)["spec"]["clusterIP"]
    route = WebhookRoute(cluster, routes, service_ip)
    route.start()
    try:
        kube.wait_until("a route to a webhook pod", lambda: route.target, 30)
        kube.wait_resource(cluster, sharing.RES, allocatable=8, timeout=60)
        cluster.kubectl("create", "namespace", TENANT_NS)

        def spec(n: int) -> kube.PodSpec:
            return kube.PodSpec(name=f"shared-{n}", script="true", limits={MEM: 1000, CORES: 10},
                                namespace=TENANT_NS, idle=False)  # fmt: skip

        def admitted() -> bool:  # raises (polled again) while the API server cannot reach the webhook yet
            cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(spec(0).manifest()))
            return True

        kube.wait_until("the webhook admitting a dry-run pod", admitted, 60)
        helm(cluster, "upgrade", sharing.RELEASE, str(CHART), "--namespace", sharing.NAMESPACE, "--reuse-values",
             "--set", f"image.tag={next_ref.rpartition(':')[2]}")  # fmt: skip

        # Shared pods created one after another while the three parts roll; each creation must be admitted.
        created: list[tuple[str, set[str]]] = []  # pod, the webhook images live when it was created
        deadline = time.monotonic() + ROLL_TIMEOUT
        while not components_rolled(cluster, next_ref):
            assert time.monotonic() < deadline, (
                f"the release did not roll\n{diagnostics(cluster, sharing.NAMESPACE, sharing.RELEASE)}"
            )
            webhooks = live(
                daemon_pods(
                    cluster, sharing.NAMESPACE, sharing.RELEASE, "app.kubernetes.io/component=webhook"
                )
            )
            pod = spec(len(created))
            out = subprocess.run(
                [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), "create", "-f", "-"],
                input=json.dumps(pod.manifest()), capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 0, f"{pod.name} refused during the upgrade: {out.stderr.strip()}"
            created.append((pod.name, {image(w) for w in webhooks}))
            # Paced by the cluster: the next one once this one is bound (or a few seconds, while the scheduler rolls).
            name = pod.name

            def bound(name: str = name) -> bool:
                return bool(kube.get_pod(cluster, name, TENANT_NS)["spec"].get("nodeName"))

            with contextlib.suppress(kube.WaitTimeout):
                kube.wait_until(f"{name} bound", bound, 3, 0.2)
    finally:
        route.close()

    assert not route.errors, route.errors
    assert len(route.targets) >= 2, route.targets  # the route followed the webhook to its new pods
    assert any(len(images) == 2 for _, images in created), created  # admitted while old and new replicas ran
    secret = cluster.kubectl_json("get", "secret", SIGNING_SECRET, "-n", sharing.NAMESPACE)
    private = signing.parse_keyring(base64.b64decode(secret["data"]["keys"]))
    keys = signing.parse_keyring(
        cluster.kubectl_json("get", "configmap", VERIFY_KEYS, "-n", sharing.NAMESPACE)["data"]["keys"],
        private_ok=False,
    )
    assert keys.public_keys.keys() == private.public_keys.keys()
    for name, _ in created:
        try:
            done = kube.wait_pod_phase(cluster, name, "Succeeded", TENANT_NS, timeout=180)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\n{diagnostics(cluster, sharing.NAMESPACE, sharing.RELEASE)}"
            ) from None
        meta = done["metadata"]
        assignment = signing.verify(
            meta["annotations"].get(signing.ASSIGNMENT_ANNOTATION),
            meta["annotations"].get(signing.SIGNATURE_ANNOTATION),
            keys,
            pod_uid=meta["uid"],
            namespace=TENANT_NS,
            name=name,
            node=NODE_NAME,
            now=time.time(),
            max_age_s=3600,
        )
        (grant,) = assignment.containers[0].devices
        assert (grant.memory_mib, grant.cores) == (1000, 10), assignment
