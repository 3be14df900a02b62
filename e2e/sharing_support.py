"""The fractional-sharing chain on the e2e cluster, as fixtures: what ``examples/sharing/smoke.py`` sets up by hand.

A second kube-scheduler (profile ``kxpu-e2e-sharing``, its own secure port) calls ``kxpu scheduler`` as its
extender; ``kxpu webhook`` serves TLS behind a Mutating and a ValidatingWebhookConfiguration scoped to the
namespace ``kxpu-sharing``; the node daemon shares two simulated NPUs (memory and cores) in ``splitCount``
slots with a key from a Secret. The test user is an impersonated tenant, so the webhook treats it as any
untrusted user would be treated; the extender and the daemon run as the admin, which the webhook trusts.
The namespace ``kxpu-sharing-raw`` is left out of the webhook to show what the node refuses on its own.

``start(node=False)`` (the benchmark's API-only nodes) runs only the extender and the second kube-scheduler and
talks to the API server through lightkube, not kubectl, so it also serves the control-plane-only cluster of a
machine without kubectl or kube-controller-manager. kxpu runs as ``.venv/bin/kxpu``, or where there is no
project venv as ``<this python> -m kxpu`` (with this process's ``PYTHONPATH``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lightkube import ApiError, Client, KubeConfig, codecs
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import (
    MutatingWebhookConfiguration,
    ValidatingWebhookConfiguration,
)
from lightkube.resources.core_v1 import Namespace, Pod, Secret, ServiceAccount

from e2e import kube
from e2e.cluster import NODE_NAME, REPO, TEST_IMAGE, Cluster, tail_file
from kxpu.sharing import signing
from kxpu.sharing.inventory import annotation_key
from kxpu.sharing.lock import lock_key
from kxpu.sharing.model import Assignment

RES = "sharing.kxpu.io/npu"
MEM = RES + "mem"
CORES = RES + "cores"
NS = "kxpu-sharing"
RAW_NS = "kxpu-sharing-raw"
SCHEDULER = "kxpu-e2e-sharing"
WEBHOOK_CONFIG = "kxpu-e2e-sharing"  # both webhook configurations' name
VERIFY_KEYS = "kxpu-verify-keys"  # the ConfigMap where the extender publishes its public keys
# As the chart: a pods/status update reaches the validating webhook only if it changes labels or annotations.
STATUS_CHANGES_METADATA = (
    "request.?subResource.orValue('') != 'status'"
    " || object.metadata.?labels.orValue({}) != oldObject.metadata.?labels.orValue({})"
    " || object.metadata.?annotations.orValue({}) != oldObject.metadata.?annotations.orValue({})"
)
SHARED_CONDITION_START = "object.spec.containers.exists(c, "


def shared_condition(names: list[str], kxpu_metadata: bool) -> str:
    """As the chart's webhook matchConditions: a pod asking for one of ``names`` (containers or init containers,
    limits or requests) and, for the validating webhook, any pod carrying or having carried kxpu.io/ annotations
    or labels. Registered by this harness too, so the e2e suite proves the API server compiles and applies it."""
    quoted = "[" + ", ".join(f"'{n}'" for n in names) + "]"
    asks_in = (
        f"c.?resources.?limits.orValue({{}}).exists(k, k in {quoted})"
        f" || c.?resources.?requests.orValue({{}}).exists(k, k in {quoted})"
    )
    out = (
        f"{SHARED_CONDITION_START}{asks_in}) || object.spec.?initContainers.orValue([]).exists(c, {asks_in})"
    )
    if kxpu_metadata:
        meta = (
            "{0}.metadata.?annotations.orValue({{}}).exists(k, k.startsWith('kxpu.io/'))"
            " || {0}.metadata.?labels.orValue({{}}).exists(k, k.startsWith('kxpu.io/'))"
        )
        out += f" || {meta.format('object')} || (oldObject != null && ({meta.format('oldObject')}))"
    return out


TRUSTED_USERS = ["kubernetes-admin"]  # the extender and the node daemon use the admin kubeconfig here
TENANT = "kxpu-e2e-tenant"  # impersonated by the tests: not trusted by the webhook
DEVICES = 2
MEMORY_MIB = 16000
SPLIT = 10
LOCK_TIMEOUT_S = 4  # an unbound pod's lock expires this fast (the extender-restart scenario relies on it)
LOCK_HARD_EXPIRY_S = (
    20  # a bound pod not admitted by then is failed and its lock freed (kubelet-down scenario)
)
ALLOCATE_TIMEOUT_S = 3  # how long the node waits for a lock naming the pod before refusing Allocate
EXTENDER_PORT, WEBHOOK_PORT, SCHEDULER_PORT, DAEMON_PORT = 18890, 18445, 10360, 19401
EXTENDER_METRICS_PORT, WEBHOOK_METRICS_PORT = 19411, 19412
REPORT_END = "end-of-report"
REPORT = f"env | grep -E '^(CUDA_|NPU_)' | sort; echo {REPORT_END}"


class Proc:
    """One host process of the chain, restartable, with a log that survives restarts."""

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str]) -> None:
        self.name, self.argv, self.log, self.env = name, argv, log, dict(env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            out.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
            )

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 15) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited; log tail:\n{tail_file(self.log, 40)}")


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    with urllib.request.urlopen(url, timeout=2, context=context) as resp:
        return bool(resp.status == 200)


def kxpu_command() -> list[str]:
    """The project venv's ``kxpu``; where there is none, this interpreter running the package."""
    venv = REPO / ".venv/bin/kxpu"
    return [str(venv)] if venv.exists() else [sys.executable, "-m", "kxpu"]


def _accepts(option: str, command: str, env: Mapping[str, str]) -> bool:
    """Whether this kxpu's subcommand has ``option`` (the metrics listeners are newer than the chain)."""
    out = subprocess.run(
        [*kxpu_command(), command, "--help"], capture_output=True, text=True, timeout=60, env=dict(env)
    )
    return option in out.stdout


def _absent(client: Client, kind: type[Namespace], name: str) -> bool:
    try:
        client.get(kind, name)
    except ApiError as exc:
        if exc.status.code == 404:
            return True
        raise
    return False


def _create(client: Client, obj: Namespace | ServiceAccount | Secret) -> None:
    """Create, or leave the one that exists."""
    try:
        client.create(obj)
    except ApiError as exc:
        if exc.status.code != 409:
            raise


def _delete_namespace(client: Client, name: str, timeout: float = 90) -> None:
    """Delete a namespace and wait until it is gone (the controller-manager's namespace controller empties it)."""
    try:
        client.delete(Namespace, name)
    except ApiError as exc:
        if exc.status.code != 404:
            raise
    kube.wait_until(f"namespace {name} deleted", lambda: _absent(client, Namespace, name), timeout)


@dataclass(frozen=True)
class Granted:
    """One container's share as the pod's signed assignment and the container's environment both say."""

    pod: str
    uuids: tuple[str, ...]
    memory_mib: int
    cores: int


class Sharing:
    """The running chain; ``start`` brings it up and waits for every part, ``close`` removes all of it."""

    def __init__(
        self,
        cluster: Cluster,
        work: Path,
        node_policy: str = "binpack",
        inventory_stale_s: float = 120,
        client_qps: int = 50,
        log_level: str = "debug",
        resource: Mapping[str, Any] | None = None,
        family: Mapping[str, Any] | None = None,
        slots: int = DEVICES * SPLIT,
        signing_scheme: str = "ed25519",
        node_lock: str = "lease",
    ) -> None:
        """``node_policy``, ``inventory_stale_s``, ``client_qps`` (kube-scheduler's), ``log_level`` (kxpu's) are
        for the benchmark. ``resource`` (the node daemon's resource entry, its ``sharing`` keys and lock filled
        in), ``family`` (the control plane's) and ``slots`` (what the node then advertises) share another
        backend than the simulated NPUs (a vendor's e2e). ``signing_scheme``: which keys sign and verify, as
        the chart's ``sharing.signing.scheme`` (``hmac``, ``hmac+ed25519``, ``ed25519+hmac``, ``ed25519``: the
        first signs, all verify); ``node_lock``: ``lease`` or ``annotation``. ``write_configs`` and a restart
        of the processes change them."""
        self.cluster, self.work = cluster, work
        self.resource = dict(resource) if resource is not None else None
        self.family = dict(family) if family is not None else {"resource": RES}
        self.res: str = self.family["resource"]
        self.slots = slots
        self.node_policy, self.inventory_stale_s, self.client_qps = node_policy, inventory_stale_s, client_qps
        self.log_level = log_level
        self.signing_scheme, self.node_lock = signing_scheme, node_lock
        self.node_signing: str | None = None
        self.key = secrets.token_urlsafe(48).encode()  # the HMAC key (Secret keys)
        self.private_pem = signing.generate_private_pem()  # the extender's Ed25519 key (Secret signing)
        self.old_private_pems: list[str] = []  # keys rotated out, still verifying the pods they signed
        kubeconfig = str(cluster.kubeconfig)
        self.env = {
            "KUBECONFIG": kubeconfig,
            "NODE_NAME": NODE_NAME,
            "PATH": "/usr/bin:/bin",
            "HOME": "/root",
        }
        if os.environ.get("PYTHONPATH"):  # kxpu from a PYTHONPATH rather than the project venv
            self.env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.api_only = False  # start(node=False) sets it
        self.ca_pem = b""  # the webhook's CA, made by start() when it runs the webhook
        kx = kxpu_command()
        self.scheduler_profile: dict[str, Any] = {}  # more of the kube-scheduler profile (restart_scheduler)
        self._write_configs()
        extender_metrics: list[str] = []
        webhook_metrics: list[str] = []
        if _accepts("--metrics-address", "scheduler", self.env):
            extender_metrics = ["--metrics-address", f"127.0.0.1:{EXTENDER_METRICS_PORT}"]
        if _accepts("--metrics-address", "webhook", self.env):
            webhook_metrics = ["--metrics-address", f"127.0.0.1:{WEBHOOK_METRICS_PORT}"]
        cp = str(work / "control-plane.yaml")
        self.daemon = self._proc(
            "node-daemon",
            [
                *kx,
                "plugin",
                "--config",
                str(work / "node.yaml"),
                "--http-address",
                f"127.0.0.1:{DAEMON_PORT}",
            ],
        )
        self.extender = self._proc(
            "extender",
            [*kx, "scheduler", "--config", cp, "--address", f"127.0.0.1:{EXTENDER_PORT}", *extender_metrics],
        )
        self.webhook = self._proc(
            "webhook",
            [
                *kx,
                "webhook",
                "--config",
                cp,
                "--address",
                f"127.0.0.1:{WEBHOOK_PORT}",
                "--tls-cert-file",
                str(work / "tls.crt"),
                "--tls-key-file",
                str(work / "tls.key"),
                *webhook_metrics,
            ],
        )
        self.scheduler = self._proc(
            "kube-scheduler-sharing",
            [
                str(cluster.k8s_bin / "kube-scheduler"),
                "--config",
                str(work / "kube-scheduler.yaml"),
                "--secure-port",
                str(SCHEDULER_PORT),
                "--v",
                "2",
            ],
            kxpu=False,
        )

    def _proc(self, name: str, argv: list[str], kxpu: bool = True) -> Proc:
        level = ["--log-level", self.log_level] if kxpu else []
        return Proc(name, argv + level, self.work / f"{name}.log", self.env)

    def _write_tls(self) -> None:
        """The webhook's serving certificate (``work/tls.{crt,key}``), signed by the cluster's CA with openssl."""
        self.cluster.issue_certificate(self.work, "tls", "kxpu-e2e-webhook", sans=["IP:127.0.0.1"])
        self.ca_pem = (self.cluster.pki / "ca.crt").read_bytes()

    @property
    def procs(self) -> list[Proc]:
        return [self.daemon, self.extender, self.webhook, self.scheduler]

    @property
    def logs(self) -> dict[str, Path]:
        return {p.name: p.log for p in self.procs}

    def write_configs(
        self, signing_scheme: str | None = None, node_lock: str | None = None, node_signing: str | None = None
    ) -> None:
        """Rewrite the configs (the processes read them when restarted); ``node_signing``: the node's keys when
        they differ from the extender's (HMAC off on the nodes while the extender still counts HMAC pods)."""
        self.signing_scheme = signing_scheme or self.signing_scheme
        self.node_lock = node_lock or self.node_lock
        self.node_signing = node_signing
        self._write_configs()

    def verify_keys(self) -> signing.Keyring:
        """Every key that verifies an assignment made in this chain: the HMAC key and every public key."""
        pems = "".join(
            signing.parse_keyring(p).public_pems() for p in [self.private_pem, *self.old_private_pems]
        )
        return signing.parse_keyring(self.key + b"\n" + pems.encode(), private_ok=False)

    def _write_configs(self) -> None:
        names = self.signing_scheme.split("+")
        node_keys = [
            {"secret": f"{NS}/keys", "hmac": True} if n == "hmac" else {"configMap": f"{NS}/{VERIFY_KEYS}"}
            for n in (self.node_signing or self.signing_scheme).split("+")
        ]
        extender_keys = [
            {"secret": f"{NS}/keys", "hmac": True} if n == "hmac" else {"secret": f"{NS}/signing"}
            for n in names
        ]
        node_signing = {"signingKey": node_keys[0], "extraKeys": node_keys[1:], "lockNamespace": NS}
        custom = None
        if self.resource is not None:
            custom = {**self.resource, "sharing": {**node_signing, **self.resource.get("sharing", {})}}
        node = {
            "version": "v1",
            "resources": [
                custom
                or {
                    "name": RES,
                    "simulated": {"count": DEVICES, "model": "snpu", "memoryMiB": MEMORY_MIB, "cores": 64},
                    "sharing": {
                        "splitCount": SPLIT,
                        **node_signing,
                        "publishIntervalSeconds": 5,
                        "visibleDevicesEnv": "NPU_VISIBLE_DEVICES",
                        "allocateTimeoutSeconds": ALLOCATE_TIMEOUT_S,
                    },
                }
            ],
        }
        control_plane = {
            "version": "v1",
            "families": [self.family],
            "schedulerName": SCHEDULER,
            "nodePolicy": self.node_policy,
            "devicePolicy": "binpack",
            "inventoryStaleSeconds": self.inventory_stale_s,
            "signingKey": extender_keys[0],
            "extraKeys": extender_keys[1:],
            "publicKeysConfigMap": f"{NS}/{VERIFY_KEYS}",
            "nodeLock": self.node_lock,
            "lockNamespace": NS,
            "lockTimeoutSeconds": LOCK_TIMEOUT_S,
            "lockHardExpirySeconds": LOCK_HARD_EXPIRY_S,
            "trustedUsers": TRUSTED_USERS,
        }
        companions = [self.family[k] for k in ("memory", "memoryPercentage", "cores") if self.family.get(k)]
        if self.resource is None:
            companions = [RES + suffix for suffix in ("mem", "mem-percentage", "cores")]
        managed = [{"name": self.res, "ignoredByScheduler": False}] + [
            {"name": name, "ignoredByScheduler": True} for name in companions
        ]
        self.managed = managed
        scheduler = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {
                "kubeconfig": str(self.cluster.kubeconfig),
                "qps": self.client_qps,
                "burst": 2 * self.client_qps,
            },
            "leaderElection": {"leaderElect": False},
            # quick retries: a bind refused while the extender restarts or the node is locked comes back soon
            "podInitialBackoffSeconds": 1,
            "podMaxBackoffSeconds": 2,
            "profiles": [{"schedulerName": SCHEDULER, **self.scheduler_profile}],
            "extenders": [
                {
                    "urlPrefix": f"http://127.0.0.1:{EXTENDER_PORT}",
                    "filterVerb": "filter",
                    "prioritizeVerb": "prioritize",
                    "bindVerb": "bind",
                    "weight": 1,
                    "nodeCacheCapable": True,
                    "enableHTTPS": False,
                    "httpTimeout": "30s",  # a bind under a burst can wait its turn; a timeout re-queues the pod
                    "managedResources": managed,
                }
            ],
        }
        for name, doc in (("node", node), ("control-plane", control_plane), ("kube-scheduler", scheduler)):
            (self.work / f"{name}.yaml").write_text(json.dumps(doc, indent=2) + "\n")

    def _webhooks(self) -> str:
        bundle = base64.b64encode(self.ca_pem).decode()
        docs = []
        for kind, path, ops, resources in (
            ("Mutating", "/mutate", ["CREATE"], ["pods"]),
            (
                "Validating",
                "/validate",
                ["CREATE", "UPDATE"],
                ["pods", "pods/status"],
            ),  # metadata goes through both
        ):
            hook = {
                "name": f"{kind.lower()}.e2e-sharing.kxpu.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "clientConfig": {"url": f"https://127.0.0.1:{WEBHOOK_PORT}{path}", "caBundle": bundle},
                "rules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ops, "resources": resources}
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
            }
            # as the chart: only pods asking for shared devices (or carrying kxpu's metadata) are sent
            names = [str(m["name"]) for m in self.managed]
            conditions = [{"name": "shared", "expression": shared_condition(names, kind == "Validating")}]
            if kind == "Validating":  # as the chart: kxpu's own updates skip the call
                users = ",".join(f"'{u}'" for u in TRUSTED_USERS)
                conditions += [
                    {
                        "name": "not-a-kxpu-update",
                        "expression": f"request.operation != 'UPDATE' || !(request.userInfo.username in [{users}])",
                    },
                    {"name": "status-changes-metadata", "expression": STATUS_CHANGES_METADATA},
                ]
            hook["matchConditions"] = conditions
            docs.append(
                {
                    "apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": f"{kind}WebhookConfiguration",
                    "metadata": {"name": WEBHOOK_CONFIG},
                    "webhooks": [hook],
                }
            )
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self, node: bool = True) -> None:
        """Everything, or (``node=False``, for API-only nodes) all but the node daemon."""
        k = self.cluster.kubectl
        self.api_only = not node
        self._write_tls()
        if node:
            for ns in (NS, RAW_NS):  # an earlier run's namespace may still be terminating
                self._kubectl_delete_namespace(ns)
                k("create", "namespace", ns)
            k("-n", NS, "create", "secret", "generic", "keys", f"--from-literal=keys={self.key.decode()}")
            self.set_signing_keys(self.private_pem, create=True)
        else:
            self._prepare_api_only()
        for proc in self.procs if node else [self.extender, self.webhook, self.scheduler]:
            proc.start()
        if node:
            k("apply", "-f", "-", input=self._webhooks())
            self.wait_node_ready()
        else:
            self._register_webhooks_api_only()
        kube.wait_until("extender /readyz", lambda: _http_ok(f"http://127.0.0.1:{EXTENDER_PORT}/readyz"), 60)
        self._wait_scheduler("healthz")
        probe = self.pod("webhook-probe", {self.family.get("memory") or MEM: 100})
        kube.wait_until("the webhook admitting a dry-run pod", lambda: self._dry_run(probe), 60)

    def set_signing_keys(self, text: str, create: bool = False) -> None:
        """The extender's Secret ``signing`` (Ed25519 PEM blocks, first signs); it re-reads it within 15 s."""
        data = base64.b64encode(text.encode()).decode()
        secret: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "signing", "namespace": NS},
        }
        secret["data"] = {"keys": data}
        self.cluster.kubectl("create" if create else "replace", "-f", "-", input=json.dumps(secret))

    def published_key_ids(self) -> set[str]:
        """The key ids of the public keys the extender published for the nodes."""
        try:
            cm = self.cluster.kubectl_json("get", "configmap", VERIFY_KEYS, "-n", NS)
        except Exception:
            return set()
        text = (cm.get("data") or {}).get("keys", "")
        return set(signing.parse_keyring(text, private_ok=False).public_keys) if text else set()

    def lock_holder(self) -> str:
        """The node lock's text: the node's Lease holder, else the node annotation ('' when free)."""
        from kxpu.sharing.lock import lease_name

        try:
            lease = self.cluster.kubectl_json("get", "lease", lease_name(NODE_NAME, RES), "-n", NS)
            held = str((lease.get("spec") or {}).get("holderIdentity") or "")
        except Exception:
            held = ""
        return held or self.node_annotations().get(lock_key(RES), "")

    def restart_scheduler(self, **profile: Any) -> None:
        """The second kube-scheduler again, its profile with ``profile`` added (e.g. ``pluginConfig``: the
        benchmark's NodeResourcesFit scoring); waits for its /readyz (informers synced)."""
        self.scheduler_profile = profile
        self._write_configs()
        self.scheduler.stop()
        self.scheduler.start()
        self._wait_scheduler("readyz")

    def _wait_scheduler(self, probe: str) -> None:
        """The second kube-scheduler's ``/healthz`` (serving) or ``/readyz`` (informers synced)."""
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        kube.wait_until(
            f"second kube-scheduler /{probe}",
            lambda: _http_ok(f"https://127.0.0.1:{SCHEDULER_PORT}/{probe}", insecure),
            60,
        )

    def reset(self) -> None:
        """Before a scenario: restart what an earlier failed scenario left stopped, wait for the node."""
        for proc in self.procs:
            if proc.proc is None or proc.proc.poll() is not None:
                proc.stop()
                proc.start()
        self.wait_node_ready()

    def _kubectl_delete_namespace(self, ns: str, check: bool = True) -> None:
        """Delete a namespace and wait until it is gone (its pods stopped by the kubelet)."""
        self.cluster.kubectl(
            "delete", "namespace", ns, "--ignore-not-found", "--wait=true", "--timeout=90s",
            check=check, timeout=120,
        )  # fmt: skip

    def wait_node_ready(self) -> None:
        """The daemon registered its slots and published the inventory the extender reads."""
        kube.wait_resource(self.cluster, self.res, allocatable=self.slots, timeout=60)
        kube.wait_until(
            "the inventory annotation on the node",
            lambda: annotation_key(self.res) in self.node_annotations(),
            60,
        )

    def _dry_run(self, manifest: dict[str, Any]) -> bool:
        if self.api_only:  # maybe no kubectl: through the API, as the admin
            with self._client() as client:
                client.create(codecs.from_dict(manifest), dry_run=True)
            return True
        self.tenant("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest))
        return True

    def _register_webhooks_api_only(self) -> None:
        """The same Mutating/ValidatingWebhookConfigurations as ``kubectl apply`` makes, through the API."""
        with self._client() as client:
            for item in json.loads(self._webhooks())["items"]:
                resource = codecs.from_dict(item)
                with contextlib.suppress(ApiError):
                    client.delete(type(resource), WEBHOOK_CONFIG)
                client.create(resource)

    def _client(self) -> Client:
        return Client(KubeConfig.from_file(self.cluster.kubeconfig), field_manager="kxpu-e2e")

    def _namespace_controller(self) -> bool:
        """Whether a controller-manager runs, whose namespace controller finishes namespace deletions."""
        return self.cluster.pid("kube-controller-manager") is not None

    def _prepare_api_only(self) -> None:
        """Through the API: both namespaces without pods, each with its ``default`` ServiceAccount (which the
        admission plugin wants before any pod, and no controller-manager may be there to make), and the key.
        Where a controller-manager runs, the namespaces are made anew (as the full chain does); otherwise nothing
        would finish deleting them, so they are emptied instead."""
        controller = self._namespace_controller()
        with self._client() as client:
            for ns in (NS, RAW_NS):
                if controller:
                    _delete_namespace(client, ns)
                _create(client, Namespace(metadata=ObjectMeta(name=ns)))
                if not controller:
                    client.deletecollection(Pod, namespace=ns, grace_period=0)  # no kubelet to wait for
                    client.deletecollection(Secret, namespace=ns)
                _create(client, ServiceAccount(metadata=ObjectMeta(name="default", namespace=ns)))
            keys = Secret(
                metadata=ObjectMeta(name="keys", namespace=NS), stringData={"keys": self.key.decode()}
            )
            client.create(keys)
            signing_key = Secret(
                metadata=ObjectMeta(name="signing", namespace=NS), stringData={"keys": self.private_pem}
            )
            client.create(signing_key)

    def _close_api_only(self) -> None:
        """Pods removed at once (no kubelet serves their nodes); namespaces deleted where a controller-manager
        can finish that, else only the key; then the processes stopped."""
        try:
            controller = self._namespace_controller()
            with self._client() as client:
                for hooks in (MutatingWebhookConfiguration, ValidatingWebhookConfiguration):
                    with contextlib.suppress(ApiError):
                        client.delete(hooks, WEBHOOK_CONFIG)
                for ns in (NS, RAW_NS):
                    client.deletecollection(Pod, namespace=ns, grace_period=0)
                    if controller:
                        _delete_namespace(client, ns)
                    else:
                        client.deletecollection(Secret, namespace=ns)
        except Exception as exc:  # clean-up: report, never hide what went wrong before it
            print(f"sharing: clean-up through the API failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            for proc in reversed(self.procs):
                proc.stop()

    def close(self) -> None:
        if self.api_only:
            self._close_api_only()
            return
        k = self.cluster.kubectl
        k(
            "delete",
            "mutatingwebhookconfiguration,validatingwebhookconfiguration",
            WEBHOOK_CONFIG,
            "--ignore-not-found",
            check=False,
        )
        with contextlib.suppress(Exception):
            self.delete_pods()
        for ns in (NS, RAW_NS):
            self._kubectl_delete_namespace(ns, check=False)
        for proc in reversed(self.procs):
            proc.stop()
        k(
            "annotate",
            "node",
            NODE_NAME,
            f"{annotation_key(self.res)}-",
            f"{lock_key(self.res)}-",
            check=False,
        )
        k("label", "node", NODE_NAME, "kxpu.io/sharing-", check=False)
        # the next scenario (any file) must not see this daemon's slots as still allocatable
        kube.wait_resource(self.cluster, self.res, allocatable=0, timeout=60)

    # -- pods -------------------------------------------------------------------------------------------------
    def tenant(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """kubectl as an ordinary user (impersonated; system:masters so RBAC is no obstacle)."""
        return self.cluster.kubectl(
            f"--as={TENANT}", "--as-group=system:masters", *args, input=input, check=check, timeout=120
        )

    def tenant_run(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """kubectl as the tenant, for requests that are meant to be denied (stderr holds the reason)."""
        cluster = self.cluster
        argv = [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), f"--as={TENANT}"]
        return subprocess.run(
            [*argv, "--as-group=system:masters", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def pod(
        self,
        name: str,
        limits: Mapping[str, int],
        annotations: Mapping[str, str] | None = None,
        namespace: str = NS,
        **spec: Any,
    ) -> dict[str, Any]:
        """A busybox pod that prints its sharing env, then idles until deleted (TERM ends it at once)."""
        body = f"trap 'exit 0' TERM\n{REPORT}\nsleep 3600 & wait\n"
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations or {})},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 2,
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "name": "main",
                        "image": TEST_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", body],
                        "resources": {"limits": {k: str(v) for k, v in limits.items()}},
                    }
                ],
                **spec,
            },
        }

    def create(self, *manifests: dict[str, Any]) -> None:
        """Create pods in one request (a List), as the tenant."""
        self.tenant(
            "create",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)}),
        )

    def pods(self, namespace: str = NS) -> list[dict[str, Any]]:
        items = self.cluster.kubectl_json("get", "pods", "-n", namespace).get("items", [])
        assert isinstance(items, list)
        return items

    def delete_pods(self) -> None:
        for ns in (NS, RAW_NS):
            self.cluster.kubectl(
                "delete",
                "pods",
                "--all",
                "-n",
                ns,
                "--wait=true",
                "--timeout=60s",
                "--ignore-not-found",
                timeout=90,
            )

    def node_annotations(self) -> dict[str, str]:
        meta = self.cluster.kubectl_json("get", "node", NODE_NAME)["metadata"]
        return dict(meta.get("annotations") or {})

    def assignment(self, pod: Mapping[str, Any]) -> Assignment:
        """The pod's assignment, verified with the cluster's key for exactly this pod and node."""
        meta = pod["metadata"]
        ann = meta.get("annotations") or {}
        return signing.verify(
            ann.get(signing.ASSIGNMENT_ANNOTATION),
            ann.get(signing.SIGNATURE_ANNOTATION),
            self.verify_keys(),
            pod_uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            node=NODE_NAME,
            now=time.time(),
            max_age_s=3600,
        )

    def reported(self, name: str, namespace: str = NS) -> dict[str, str]:
        """The sharing env the container printed."""
        log = kube.wait_pod_log(self.cluster, name, REPORT_END, namespace)
        return dict(line.split("=", 1) for line in log.splitlines() if "=" in line)

    def granted(self, pod: Mapping[str, Any]) -> Granted:
        """What the signed assignment grants the pod's container; asserts the container was told the same."""
        name = pod["metadata"]["name"]
        assignment = self.assignment(pod)
        (container,) = assignment.containers
        assert container.resource == RES, assignment
        env = self.reported(name)
        uuids = tuple(g.uuid for g in container.devices)
        assert env.get("NPU_VISIBLE_DEVICES") == ",".join(uuids), (name, env, assignment)
        for i, grant in enumerate(container.devices):
            assert env.get(f"CUDA_DEVICE_MEMORY_LIMIT_{i}") == f"{grant.memory_mib}m", (name, env, assignment)
        cores = container.devices[0].cores
        if 0 < cores < 100:
            assert env.get("CUDA_DEVICE_SM_LIMIT") == str(cores), (name, env, assignment)
        else:
            assert "CUDA_DEVICE_SM_LIMIT" not in env, (name, env, assignment)
        memory = {g.memory_mib for g in container.devices}
        assert len(memory) == 1, assignment
        return Granted(name, uuids, memory.pop(), cores)


def assert_within_capacity(grants: Iterable[Granted]) -> dict[str, tuple[int, int, int]]:
    """Per device: (memory MiB, cores %, containers) granted, each within capacity x scaling and the split."""
    usage: dict[str, list[int]] = {}
    for g in grants:
        for uuid in g.uuids:
            used = usage.setdefault(uuid, [0, 0, 0])
            used[0] += g.memory_mib
            used[1] += g.cores
            used[2] += 1
    for uuid, (memory, cores, slots) in usage.items():
        assert memory <= MEMORY_MIB, f"{uuid}: {memory} MiB granted of {MEMORY_MIB}: {usage}"
        assert cores <= 100, f"{uuid}: {cores}% cores granted: {usage}"
        assert slots <= SPLIT, f"{uuid}: {slots} containers on {SPLIT} slots: {usage}"
    return {u: (m, c, s) for u, (m, c, s) in usage.items()}


def events(cluster: Cluster, name: str, namespace: str = NS, reason: str | None = None) -> list[str]:
    """Messages of the pod's events (of one reason)."""
    return [
        str(e.get("message", ""))
        for e in kube.events_for(cluster, name, namespace)
        if reason is None or e.get("reason") == reason
    ]


@contextlib.contextmanager
def running_chain(cluster: Cluster, work: Path, **options: Any) -> Iterator[Sharing]:
    """A started chain for a test module, stopped at the end; one that does not come up fails the module
    with the tails of its processes' logs."""
    sharing = Sharing(cluster, work, **options)
    try:
        sharing.start()
    except BaseException:
        logs = "\n".join(f"--- {n} ---\n{tail_file(p, 40)}" for n, p in sharing.logs.items())
        sharing.close()
        pytest.fail(f"the sharing chain did not come up:\n{logs}", pytrace=False)
    try:
        yield sharing
    finally:
        sharing.close()
