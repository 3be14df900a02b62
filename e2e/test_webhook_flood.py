"""The chart's admission webhook under a flood from "the pod network", on the real cluster (issue 19).

Anyone who can reach the webhook's port can send it anything. With ``failurePolicy: Fail`` a webhook that
stalls or dies used to stop pod creation for the whole cluster. Here the scenario floods one webhook replica
(its pod IP, from this machine: only the cluster's own addresses are used) with oversized bodies (declared and
chunked), slow clients trickling their headers, hundreds of idle connections, deeply nested JSON and large
valid reviews, while it creates ordinary pods and checks that:

- ordinary pods are admitted without delay, and are not even sent to the webhook (its ``mutate`` count does not
  move: the chart's ``matchConditions`` send only pods asking for shared resources);
- once the flood stops, a pod asking for shared devices is admitted within the API server's timeout for the
  webhook (``timeoutSeconds``, 5 s) at the first try, and runs;
- the webhook's peak RSS stays under its memory limit, and it never restarted.

Every loop is bounded (a deadline and a stop event); every socket is closed at the end.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import ssl
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from e2e import kube
from e2e.cluster import NODE_NAME, Cluster
from e2e.test_helm import daemon_pods
from e2e.test_helm_sharing import (
    CORES,
    DEVICES,
    MEM,
    NAMESPACE,
    RELEASE,
    RES,
    SPLIT,
    TENANT_NS,
    WEBHOOK,
    ServiceRoutes,
    release,
    wait_ready,
)
from e2e.test_helm_sharing import pytestmark as helm_sharing_skips
from kxpu.sharing.inventory import annotation_key

pytestmark = helm_sharing_skips
__all__ = ["release"]  # the fixture, shared with test_helm_sharing.py

WEBHOOK_PORT = 8443
MEMORY_LIMIT = 256 * 1024 * 1024  # the chart's webhook.resources.limits.memory
FLOOD_S = 90.0  # the flood's own deadline, whatever happens to the test


class Flood:
    """Threads that attack one TLS endpoint until ``stop`` (or their deadline); ``seen`` counts what came back."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.stop = threading.Event()
        self.deadline = time.monotonic() + FLOOD_S
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._context = ssl.create_default_context()
        self._context.check_hostname = False
        self._context.verify_mode = ssl.CERT_NONE  # a test client of garbage; the server's name is irrelevant

    def running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def note(self, what: str) -> None:
        with self._lock:
            self.seen[what] += 1

    def connect(self) -> ssl.SSLSocket | None:
        try:
            raw = socket.create_connection((self.host, self.port), timeout=5)
            return self._context.wrap_socket(raw, server_hostname="flood")
        except OSError:
            self.note("connect-refused")
            return None

    def answer(self, sock: ssl.SSLSocket) -> None:
        try:
            head = sock.recv(64)
        except OSError:
            head = b""
        self.note(head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1 ") else "closed")

    def post(self, body: bytes, path: str = "/validate") -> None:
        sock = self.connect()
        if sock is None:
            return
        with sock:
            try:
                head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            except OSError:
                self.note("send-refused")
                return
            self.answer(sock)

    # -- the attacks ----------------------------------------------------------------------------------------------
    def oversized(self) -> None:
        """8 MiB bodies: declared (refused from the header, before a byte of the body is read) and chunked
        (refused once past the limit)."""
        chunk = b"a" * (256 * 1024)
        while self.running():
            sock = self.connect()
            if sock is not None:
                with sock:
                    try:
                        sock.sendall(
                            b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 8388608\r\n\r\n{"
                        )
                    except OSError:
                        self.note("send-refused")
                    else:
                        self.answer(sock)
            sock = self.connect()
            if sock is None:
                continue
            with sock:
                try:
                    sock.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for _ in range(32):  # 8 MiB
                        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                except OSError:
                    pass  # cut off past the limit: what the server said, if anything, is still to be read
                self.answer(sock)

    def parse_work(self) -> None:
        """Deep nesting (past any recursion limit) and large valid reviews (parsed off the event loop)."""
        deep = b'{"request": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        annotations = {f"example.com/a{i}": "v" * 200 for i in range(12_000)}  # about 2.7 MiB
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "flood",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "operation": "CREATE",
                "userInfo": {"username": "flood"},
                "object": {"metadata": {"name": "big", "namespace": "x", "annotations": annotations},
                           "spec": {"containers": [{"name": "c", "image": "busybox"}]}},
            },
        }  # fmt: skip
        big = json.dumps(review).encode()
        while self.running():
            self.post(deep)
            self.post(big)

    def hold(self, count: int, trickle: bool) -> None:
        """``count`` connections held open: idle after the handshake, or trickling a header byte at a time."""
        socks: list[ssl.SSLSocket] = []
        try:
            while self.running():
                while len(socks) < count and self.running():
                    sock = self.connect()
                    if sock is None:
                        break
                    socks.append(sock)
                closed = set(select.select(socks, [], [], 0)[0]) if socks else set()  # readable: EOF or reset
                for sock in list(socks):
                    try:
                        if trickle:
                            sock.sendall(b"X")
                        if sock in closed and not sock.recv(1):
                            raise ConnectionResetError
                    except OSError:
                        socks.remove(sock)
                        sock.close()
                        self.note("slow-cut" if trickle else "idle-cut")
                self.stop.wait(0.5)
        finally:
            for sock in socks:
                sock.close()

    def start(self) -> None:
        attacks: list[Callable[[], None]] = [
            self.oversized,
            self.oversized,
            self.parse_work,
            lambda: self.hold(100, trickle=True),
            lambda: self.hold(300, trickle=False),
        ]
        for attack in attacks:
            thread = threading.Thread(target=attack, daemon=True)
            thread.start()
            self._threads.append(thread)

    def end(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        assert not [t for t in self._threads if t.is_alive()], "a flood thread did not stop"


@contextlib.contextmanager
def flooding(host: str, port: int) -> Iterator[Flood]:
    flood = Flood(host, port)
    flood.start()
    try:
        yield flood
    finally:
        flood.end()


def mutations(pod_ip: str) -> float:
    """The webhook's count of /mutate reviews, from its metrics port (plain HTTP, outside the flood)."""
    with contextlib.closing(urllib.request.urlopen(f"http://{pod_ip}:9402/metrics", timeout=10)) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kxpu_webhook_admissions_total{") and 'webhook="mutate"' in line
    )


def peak_rss(cluster: Cluster, pod: dict[str, object]) -> int:
    """The webhook process's peak resident memory (VmHWM), in bytes, read from /proc on this machine."""
    statuses = pod["status"]["containerStatuses"]  # type: ignore[index]
    container_id = statuses[0]["containerID"].rpartition("/")[2]
    tasks = cluster.ctr("task", "ls").splitlines()
    (pid,) = [line.split()[1] for line in tasks if line.startswith(container_id)]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def create_timed(cluster: Cluster, manifest: dict[str, object]) -> float:
    started = time.monotonic()
    cluster.kubectl("create", "-f", "-", input=json.dumps(manifest))
    return time.monotonic() - started


def test_a_flood_never_blocks_ordinary_pods_and_the_webhook_recovers(
    release: tuple[Cluster, ServiceRoutes],
) -> None:
    cluster, routes = release
    wait_ready(cluster, "scheduler")
    wait_ready(cluster, "webhook", count=2)  # two replicas and a PodDisruptionBudget
    wait_ready(cluster, "plugin")
    assert cluster.kubectl_json("get", "pdb", WEBHOOK, "-n", NAMESPACE)["spec"]["minAvailable"] == 1
    (target, *_) = daemon_pods(cluster, NAMESPACE, RELEASE, "app.kubernetes.io/component=webhook")
    pod_ip = target["status"]["podIP"]
    service_ip = cluster.kubectl_json("get", "service", WEBHOOK, "-n", NAMESPACE)["spec"]["clusterIP"]
    routes.service_for_host(service_ip, pod_ip, WEBHOOK_PORT)  # the API server reaches this replica
    kube.wait_resource(cluster, RES, allocatable=DEVICES * SPLIT, timeout=60)
    kube.wait_until(
        "the inventory annotation on the node",
        lambda: (
            annotation_key(RES) in cluster.kubectl_json("get", "node", NODE_NAME)["metadata"]["annotations"]
        ),
        60,
    )
    cluster.kubectl("create", "namespace", TENANT_NS)
    shared = kube.PodSpec(name="shared", script="true", limits={MEM: 2000, CORES: 20}, namespace=TENANT_NS)
    manifest = shared.manifest()

    def admitted() -> bool:  # raises (and is polled again) until the API server reaches the webhook
        cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest))
        return True

    kube.wait_until("the webhook admitting a dry-run shared pod", admitted, 60)

    before = mutations(pod_ip)
    with flooding(pod_ip, WEBHOOK_PORT) as flood:
        kube.wait_until("the flood under way", lambda: sum(flood.seen.values()) > 20, 30)
        took = []
        for n in range(8):
            plain = kube.PodSpec(name=f"plain-{n}", script="true", namespace=TENANT_NS, idle=False)
            took.append(create_timed(cluster, plain.manifest()))
        # every attack got its answer from the webhook (413 too large, 400 nested too deeply) at least once
        kube.wait_until(
            "the webhook refusing oversized and deeply nested bodies",
            lambda: flood.seen["413"] > 0 and flood.seen["400"] > 0,
            45,
        )
        seen = dict(flood.seen)
    # kubectl's own start-up on this small machine is most of each; the webhook's timeout is 5 s
    assert max(took) < 4.0, f"ordinary pods waited during the flood: {took} (flood: {seen})"
    # they were not sent to the webhook at all: its mutate count moved by none of them
    assert mutations(pod_ip) == before, "an ordinary pod was sent to the webhook"

    # once the flood stops, a shared pod is admitted at the first try, within the webhook's timeout, and runs
    took_shared = create_timed(cluster, manifest)
    assert took_shared < 5.0, f"a shared pod took {took_shared:.1f}s to be admitted after the flood"
    kube.wait_pod_phase(cluster, shared.name, "Running", TENANT_NS, timeout=90)
    assert mutations(pod_ip) > before

    target = kube.get_pod(cluster, target["metadata"]["name"], NAMESPACE)
    assert target["status"]["containerStatuses"][0]["restartCount"] == 0, target["status"]
    rss = peak_rss(cluster, target)
    assert rss < MEMORY_LIMIT * 0.8, f"the webhook's peak RSS was {rss / 2**20:.0f} MiB (limit 256 MiB)"
    print(f"flood: {seen}; ordinary pods admitted in {max(took):.2f}s at most; shared pod in {took_shared:.2f}s; "
          f"webhook peak RSS {rss / 2**20:.0f} MiB")  # fmt: skip
