"""Lifecycle of a real single-node Kubernetes cluster local to this host, built from upstream components.

``python -m e2e.cluster up|down|status|env``. ``up`` starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, containerd (CDI enabled) and the kubelet from the binaries ``hack/cluster/build.sh`` cached,
with certificates made here by ``openssl``, imports locally built images (there is no registry) and waits until
the node is Ready. Everything lives in one state directory (``KXPU_E2E_STATE``, default ``/var/lib/kxpu-e2e``)
except the kubelet's root directory, which stays the standard ``/var/lib/kubelet`` so that device plugins find
``/var/lib/kubelet/device-plugins`` as on any node. ``down`` deletes the pods, stops only the processes whose
PIDs ``up`` recorded (checked against their executable), unmounts what is mounted under its directories and
removes them. Standard library only, so it runs from any Python >= 3.11.

``--control-plane-only`` (``Cluster.default(control_plane_only=True)``) is a second, node-less mode for work
on API-only Node objects (``bench/bench_sharing_e2e.py``): etcd, kube-apiserver and kube-scheduler, plus
kube-controller-manager where its binary exists; no containerd, kubelet, CNI, runc, images or host
directories. It keeps its own state directory (``KXPU_E2E_CP_STATE``, default ``/var/lib/kxpu-e2e-cp``) but
the same ports, so each mode refuses to start while the other runs. Without a controller-manager, ``up``
creates the ``default`` ServiceAccount of namespace ``default`` itself (the admission plugin wants it before
any pod); namespaces made later need theirs made by whoever makes them. ``KXPU_K8S_BIN`` overrides the
directory of the Kubernetes binaries (in both modes), e.g. for a folder of unpacked binaries.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from e2e import oci

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "hack" / "cluster" / "build.sh"

NODE_NAME = "kxpu-e2e"
KUBELET_ROOT = Path("/var/lib/kubelet")
DEVICE_PLUGIN_DIR = KUBELET_ROOT / "device-plugins"
CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
API_PORT = 6443
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
KUBE_SCHEDULER_PORT = 10259  # the cluster kube-scheduler's (default) secure port
SERVICE_CIDR = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the "kubernetes" service
POD_SUBNET = "10.244.77.0/24"  # private pod range behind the kxpu0 bridge; no masquerade, stays on the host
BRIDGE = "kxpu0"
# The kubelet refuses a loopback node IP, so the node gets a private address on a port-less bridge: reachable
# only from this host, like loopback, but a valid InternalIP for the API server to reach the kubelet by.
NODE_IP = "10.244.76.1"
NODE_LINK = "kxpu-node"
CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBEPODS = "kubepods"  # the kubelet's cgroup (cgroupfs driver) under every v1 hierarchy
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
RUNC = Path("/usr/sbin/runc")  # Debian's runc
PAUSE_IMAGE = "kxpu.local/pause:v1"
TEST_IMAGE = "kxpu.local/busybox:v1"
CONTAINERD_RUN = Path("/run/containerd")  # containerd 1.7 keeps shim sockets here whatever its state dir
HOST_DIRS = (KUBELET_ROOT, CONTAINERD_RUN, *CDI_DIRS)
CREATED_FILE = "created-host-dirs.json"
OWNED_MARKER = ".kxpu-e2e-owned"
# What a kubelet writes in its root besides pods and plugins (removed from a root that is not ours).
KUBELET_STATE_FILES = (
    "cpu_manager_state",
    "memory_manager_state",
    "dra_manager_state",
    "allocated_pods_state",
    "actuated_pods_state",
    "device-plugins/kubelet_internal_checkpoint",
    "device-plugins/kubelet.sock",
)

# One user of the cluster at a time: an e2e session holds this lock from start to end (its scenarios restart
# the kubelet, which another session would take for a dead cluster); up and down take it too.
LOCK_FILE = Path("/run/kxpu-e2e.lock")

# Start order; down stops them in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "containerd", "kubelet")
# The control-plane-only mode: these (kube-controller-manager only where its binary exists).
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
OPTIONAL_CONTROL_PLANE = ("kube-controller-manager",)
K8S_BIN_ENV = "KXPU_K8S_BIN"  # a directory of Kubernetes binaries instead of build.sh's cache


class ClusterError(RuntimeError):
    """The cluster could not be brought up or torn down; the message names the log to read."""


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} cluster: {msg}", file=sys.stderr, flush=True)


def wait_for(
    what: str, check: Callable[[], bool], timeout: float, hint: str = "", interval: float = 0.25
) -> None:
    """Poll ``check`` until it is true; raise with ``what`` and ``hint`` (e.g. a log path) at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # a component still starting answers with errors; keep polling
            pass
        if time.monotonic() > deadline:
            raise ClusterError(
                f"timed out after {timeout:.0f}s waiting for {what}" + (f"; see {hint}" if hint else "")
            )
        time.sleep(interval)


def build_paths() -> tuple[Path, Path, str]:
    """The cached binary directories and the Kubernetes release (``KXPU_K8S_RELEASE``, default the newest
    tested), as build.sh computes them."""
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "paths"], check=True, capture_output=True, text=True
    ).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return Path(values["K8S_BIN"]), Path(values["CONTAINERD_BIN"]), values["K8S_RELEASE"]


def state_dir(control_plane_only: bool) -> Path:
    if control_plane_only:
        return Path(os.environ.get("KXPU_E2E_CP_STATE", "/var/lib/kxpu-e2e-cp"))
    return Path(os.environ.get("KXPU_E2E_STATE", "/var/lib/kxpu-e2e"))


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Paths of one cluster instance; every method is safe to call whether or not it is up."""

    state: Path
    k8s_bin: Path
    containerd_bin: Path
    control_plane_only: bool = False
    release: str = ""  # the Kubernetes minor release, e.g. "1.37" (KXPU_K8S_RELEASE)

    @classmethod
    def default(cls, control_plane_only: bool = False) -> Cluster:
        """The normal cluster, or the control-plane-only one (its own state directory, the same ports)."""
        k8s_bin, containerd_bin, release = build_paths()
        if os.environ.get(K8S_BIN_ENV):
            k8s_bin = Path(os.environ[K8S_BIN_ENV]).resolve()
        return cls(state_dir(control_plane_only), k8s_bin, containerd_bin, control_plane_only, release)

    @property
    def release_tuple(self) -> tuple[int, int]:
        """(1, 37) for "1.37"; (0, 0) when unknown."""
        try:
            major, minor = self.release.split(".")[:2]
            return int(major), int(minor)
        except ValueError:
            return (0, 0)

    def sibling(self) -> Cluster:
        """The other mode's cluster on this host (same binaries): it uses the same ports as this one."""
        other = not self.control_plane_only
        return dataclasses.replace(self, state=state_dir(other), control_plane_only=other)

    @property
    def components(self) -> tuple[str, ...]:
        """What this mode runs, in start order."""
        if not self.control_plane_only:
            return COMPONENTS
        return tuple(c for c in CONTROL_PLANE if c not in OPTIONAL_CONTROL_PLANE or self._binary(c).is_file())

    # -- paths ------------------------------------------------------------------------------------------------
    @property
    def pki(self) -> Path:
        return self.state / "pki"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (system:masters) for kubectl and the tests."""
        return self.state / "admin.kubeconfig"

    @property
    def kubectl_bin(self) -> Path:
        return self.k8s_bin / "kubectl"

    @property
    def containerd_sock(self) -> Path:
        return self.state / "containerd" / "containerd.sock"

    def log_file(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def _pid_file(self, component: str) -> Path:
        return self.state / "pids" / f"{component}.pid"

    def _binary(self, component: str) -> Path:
        return (self.containerd_bin if component == "containerd" else self.k8s_bin) / component

    # -- helpers ----------------------------------------------------------------------------------------------
    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        """Run kubectl against this cluster and return stdout; raise with stderr when ``check`` fails."""
        proc = subprocess.run(
            [str(self.kubectl_bin), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def kubectl_json(self, *args: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.kubectl(*args, "-o", "json"))
        return out

    def ctr(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(
            [str(self.containerd_bin / "ctr"), "--address", str(self.containerd_sock), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"ctr {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def pid(self, component: str) -> int | None:
        """PID of a running component this harness started, or None; its executable must be the one recorded at
        start (no PID reuse), whichever release's binary that was."""
        try:
            recorded = self._pid_file(component).read_text().split(maxsplit=1)
            pid = int(recorded[0])
            binary = recorded[1].strip() if len(recorded) > 1 else str(self._binary(component))
            exe = os.readlink(f"/proc/{pid}/exe")
        except (OSError, ValueError, IndexError):
            return None
        # A binary replaced in the cache while running shows as "<path> (deleted)"; it is still ours.
        return pid if exe.removesuffix(" (deleted)") == binary else None

    def running(self) -> dict[str, int | None]:
        return {c: self.pid(c) for c in self.components}

    def tail(self, component: str, lines: int = 60) -> str:
        """Last lines of a component log (for failure reports)."""
        return tail_file(self.log_file(component), lines)

    # -- up ---------------------------------------------------------------------------------------------------
    def up(self) -> None:
        """Bring the cluster up and wait until the node is Ready and the default service account exists."""
        if self.control_plane_only:
            self._up_control_plane()
            return
        if os.geteuid() != 0:
            raise ClusterError("the e2e cluster needs root (kubelet, containerd, mounts, cgroups, network)")
        missing = [c for c in COMPONENTS if not self._binary(c).is_file()]
        if missing:
            raise ClusterError(
                f"missing binaries {missing}; run hack/cluster/build.sh (make cluster-build) first"
            )
        for tool in ("openssl", str(RUNC), str(CNI_BIN_DIR / "bridge")):
            if not shutil.which(tool):
                raise ClusterError(f"{tool} not found; run hack/cluster/build.sh deps")
        if self._already_up(self._node_ready, "already up"):
            return
        self._refuse_if_sibling_up()
        t0 = time.monotonic()
        for sub in ("pki", "logs", "pids", "etcd", "containerd", "cni/net.d", "cni/ipam", "images", "runc"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self._make_host_dirs()
        self._certificates()
        self._kubeconfigs()
        self._configs()

        self._start("etcd", self._etcd_args())
        self._start(
            "containerd", [str(self._binary("containerd")), "--config", str(self.state / "containerd.toml")]
        )
        wait_for("etcd health", self._etcd_healthy, 60, str(self.log_file("etcd")))
        self._start("kube-apiserver", self._apiserver_args())
        # Images are written and imported while the API server starts.
        wait_for("containerd socket", self._containerd_ready, 60, str(self.log_file("containerd")))
        self._images()
        wait_for("kube-apiserver /readyz", self._apiserver_ready, 120, str(self.log_file("kube-apiserver")))
        self._start("kube-controller-manager", self._controller_manager_args())
        self._start("kube-scheduler", self._scheduler_args())
        self._start("kubelet", self._kubelet_args())
        wait_for(f"node {NODE_NAME} Ready", self._node_ready, 120, str(self.log_file("kubelet")))
        wait_for(
            "default service account and kube-root-ca.crt in namespace default",
            self._default_sa_ready,
            60,
            str(self.log_file("kube-controller-manager")),
        )
        log(
            f"up in {time.monotonic() - t0:.1f}s (Kubernetes {self.release}); export KUBECONFIG={self.kubeconfig}"
        )

    def _up_control_plane(self) -> None:
        """etcd, kube-apiserver, kube-scheduler (and kube-controller-manager if built); wait for /readyz and
        the default ServiceAccount of namespace ``default`` (made here when no controller-manager runs)."""
        if os.geteuid() != 0:
            raise ClusterError(
                "the e2e cluster needs root (its state directory, lock and the component ports)"
            )
        missing = [c for c in self.components if not self._binary(c).is_file()]
        if missing:
            raise ClusterError(
                f"missing binaries {missing} in {self.k8s_bin}; run hack/cluster/build.sh k8s or set "
                f"{K8S_BIN_ENV} to a directory holding them"
            )
        if not shutil.which("openssl"):
            raise ClusterError("openssl not found (it makes the certificates)")
        if self._already_up(self._control_plane_ready, "already up, control plane only"):
            return
        self._refuse_if_sibling_up()
        busy = [port for port in (API_PORT, ETCD_CLIENT_PORT, ETCD_PEER_PORT) if _listening(port)]
        if busy:
            raise ClusterError(f"ports {busy} on 127.0.0.1 are taken by something else; free them first")
        t0 = time.monotonic()
        for sub in ("pki", "logs", "pids", "etcd"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self._certificates()
        self._kubeconfigs()
        self._start("etcd", self._etcd_args())
        wait_for("etcd health", self._etcd_healthy, 60, str(self.log_file("etcd")))
        self._start("kube-apiserver", self._apiserver_args())
        wait_for("kube-apiserver /readyz", self._apiserver_ready, 120, str(self.log_file("kube-apiserver")))
        if "kube-controller-manager" in self.components:
            self._start("kube-controller-manager", self._controller_manager_args())
        self._start("kube-scheduler", self._scheduler_args())
        if "kube-controller-manager" in self.components:
            wait_for(
                "default service account in namespace default",
                lambda: self._api_exists("/api/v1/namespaces/default/serviceaccounts/default"),
                60,
                str(self.log_file("kube-controller-manager")),
            )
        else:  # nothing else makes it; the ServiceAccount admission plugin refuses pods without it
            wait_for(
                "default service account in namespace default",
                self._create_default_service_account,
                30,
                str(self.log_file("kube-apiserver")),
            )
        wait_for("kube-scheduler /healthz", self._scheduler_healthy, 60, str(self.log_file("kube-scheduler")))
        log(
            f"up in {time.monotonic() - t0:.1f}s, control plane only ({', '.join(self.components)}); "
            f"export KUBECONFIG={self.kubeconfig}"
        )

    def _already_up(self, ready: Callable[[], bool], what: str) -> bool:
        """Whether an earlier ``up`` left this cluster running and ready; stale state is torn down."""
        if not self.state.exists():
            return False
        if all(self.running().values()) and ready():
            log(f"{what} (state {self.state})")
            return True
        log(f"stale state in {self.state}; tearing it down first")
        self.down()
        return False

    def _refuse_if_sibling_up(self) -> None:
        """The two modes share ports: start neither while the other runs."""
        other = self.sibling()
        up = [c for c, pid in other.running().items() if pid]
        if up:
            mode = "normal" if self.control_plane_only else "control-plane-only"
            flag = "" if self.control_plane_only else " --control-plane-only"
            raise ClusterError(
                f"the {mode} e2e cluster is running ({', '.join(up)}; state {other.state}) on the same ports; "
                f"stop it first with: python3 -m e2e.cluster down{flag}"
            )

    def _make_host_dirs(self) -> None:
        """Create what lives outside the state dir; remember which were ours so that down removes only those."""
        # A directory holding our marker was made by an earlier run that could not clean up: still ours.
        created = [str(d) for d in HOST_DIRS if not d.exists() or (d / OWNED_MARKER).exists()]
        if not any((h / KUBEPODS).exists() for h in CGROUP_ROOT.iterdir()):
            created.append(KUBEPODS)
        for d in HOST_DIRS:
            d.mkdir(parents=True, exist_ok=True)
        for d in (KUBELET_ROOT, CONTAINERD_RUN):
            if str(d) in created:
                (d / OWNED_MARKER).touch()
        if not Path(f"/sys/class/net/{NODE_LINK}").exists():
            created.append(NODE_LINK)
            for cmd in (
                ["ip", "link", "add", NODE_LINK, "type", "bridge"],
                ["ip", "addr", "add", f"{NODE_IP}/32", "dev", NODE_LINK],
                ["ip", "link", "set", NODE_LINK, "up"],
            ):
                _run(cmd)
        (self.state / CREATED_FILE).write_text(json.dumps(created))

    def _start(self, component: str, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        out = self.log_file(component).open("ab")
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the harness; not killed with its process group
            env=env or self._env(),
            cwd=self.state,
        )
        out.close()
        self._pid_file(component).write_text(f"{proc.pid} {argv[0]}\n")
        log(f"started {component} (pid {proc.pid}); log {self.log_file(component)}")

    def _env(self) -> dict[str, str]:
        path = f"{self.containerd_bin}:{self.k8s_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        return {"PATH": path, "HOME": "/root", "LANG": "C.UTF-8"}

    # -- certificates and configs -----------------------------------------------------------------------------
    def _certificates(self) -> None:
        """A CA and one EC key/certificate per identity; the service-account signing key."""
        pki = self.pki
        _openssl_conf(pki / "ca.cnf", "kxpu-e2e-ca", None, ca=True)
        _run(
            [
                "openssl",
                "req",
                "-x509",
                "-new",
                "-nodes",
                "-config",
                str(pki / "ca.cnf"),
                "-extensions",
                "ext",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-keyout",
                str(pki / "ca.key"),
                "-out",
                str(pki / "ca.crt"),
                "-days",
                "3650",
            ]
        )
        api_sans = [
            "IP:127.0.0.1",
            f"IP:{SERVICE_IP}",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
        identities: dict[str, tuple[str, str | None, list[str] | None]] = {
            "apiserver": ("kube-apiserver", None, api_sans),
            "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters", None),
            "admin": ("kubernetes-admin", "system:masters", None),
            "front-proxy-client": ("front-proxy-client", None, None),
            "controller-manager": ("system:kube-controller-manager", None, None),
            "scheduler": ("system:kube-scheduler", None, None),
            "kubelet-client": (f"system:node:{NODE_NAME}", "system:nodes", None),
            "kubelet": (
                NODE_NAME,
                None,
                [f"IP:{NODE_IP}", "IP:127.0.0.1", f"DNS:{NODE_NAME}", "DNS:localhost"],
            ),
        }
        for name, (cn, org, sans) in identities.items():
            self.issue_certificate(pki, name, cn, org, sans)
        _run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(pki / "sa.key")])
        _run(["openssl", "ec", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub")])
        (pki / "ca.key").chmod(0o600)
        (pki / "sa.key").chmod(0o600)

    def issue_certificate(
        self, into: Path, name: str, cn: str, org: str | None = None, sans: list[str] | None = None
    ) -> tuple[Path, Path]:
        """An EC key and a certificate signed by the cluster's CA, as ``into/name.{crt,key}`` (serving if ``sans``)."""
        conf = into / f"{name}.cnf"
        _openssl_conf(conf, cn, org, sans=sans)
        key, csr, crt = (into / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        _run(
            [
                "openssl",
                "req",
                "-new",
                "-nodes",
                "-config",
                str(conf),
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-keyout",
                str(key),
                "-out",
                str(csr),
            ]
        )
        _run(
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                str(csr),
                "-CA",
                str(self.pki / "ca.crt"),
                "-CAkey",
                str(self.pki / "ca.key"),
                "-set_serial",
                str(int.from_bytes(os.urandom(8), "big")),
                "-days",
                "365",
                "-extfile",
                str(conf),
                "-extensions",
                "ext",
                "-out",
                str(crt),
            ]
        )
        key.chmod(0o600)
        return crt, key

    def _kubeconfigs(self) -> None:
        for name, cert in [
            ("admin", "admin"),
            ("controller-manager", "controller-manager"),
            ("scheduler", "scheduler"),
            ("kubelet", "kubelet-client"),
        ]:
            config = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "kxpu-e2e",
                        "cluster": {
                            "server": f"https://127.0.0.1:{API_PORT}",
                            "certificate-authority": str(self.pki / "ca.crt"),
                        },
                    }
                ],
                "users": [
                    {
                        "name": name,
                        "user": {
                            "client-certificate": str(self.pki / f"{cert}.crt"),
                            "client-key": str(self.pki / f"{cert}.key"),
                        },
                    }
                ],
                "contexts": [{"name": "kxpu-e2e", "context": {"cluster": "kxpu-e2e", "user": name}}],
                "current-context": "kxpu-e2e",
            }
            (self.state / f"{name}.kubeconfig").write_text(json.dumps(config, indent=2) + "\n")

    def _configs(self) -> None:
        """containerd (CRI with CDI, local pause image, runc with cgroupfs), CNI bridge, kubelet."""
        s = self.state
        (s / "containerd.toml").write_text(f"""\
version = 2
root = "{s}/containerd/root"
state = "{s}/containerd/state"

[grpc]
  address = "{self.containerd_sock}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{s}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  # Root here may lack CAP_SYS_RESOURCE (test VMs, nested containers): runc then cannot give the sandbox its
  # usual oom_score_adj of -998. Clamp adjustments at containerd's own instead of failing every sandbox.
  restrict_oom_score_adj = {"true" if not _has_cap_sys_resource() else "false"}

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        Root = "{s}/runc"
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{s}/cni/net.d"
""")
        cni = {
            "cniVersion": "1.0.0",
            "name": "kxpu-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET}]],
                        # Service IPs through the host (only the pod subnet is routed otherwise): there is no
                        # kube-proxy, but a scenario may add the NAT rules for the Services it needs.
                        "routes": [{"dst": SERVICE_CIDR}],
                        "dataDir": str(s / "cni" / "ipam"),
                    },
                }
            ],
        }
        (s / "cni" / "net.d" / "10-kxpu-e2e.conflist").write_text(json.dumps(cni, indent=2) + "\n")
        # KubeletConfiguration v1beta1, written as JSON (which is YAML).
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "address": NODE_IP,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "tlsCertFile": str(self.pki / "kubelet.crt"),
            "tlsPrivateKeyFile": str(self.pki / "kubelet.key"),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.pki / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDomain": "cluster.local",
            "resolvConf": "/etc/resolv.conf",
            # Report device-plugin capacity changes quickly (the default is 10s).
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "10s",
            # A test VM's disk may be fuller than a node's; never evict the test pods or GC the local images.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "failCgroupV1": False,  # this host has cgroup v1; 1.35+ refuses it unless told
            "rotateCertificates": False,
            "serializeImagePulls": False,
        }
        (s / "kubelet.yaml").write_text(json.dumps(kubelet, indent=2) + "\n")

    # -- component command lines ------------------------------------------------------------------------------
    def _etcd_args(self) -> list[str]:
        client = f"http://127.0.0.1:{ETCD_CLIENT_PORT}"
        peer = f"http://127.0.0.1:{ETCD_PEER_PORT}"
        return [
            str(self._binary("etcd")),
            "--name",
            NODE_NAME,
            "--data-dir",
            str(self.state / "etcd"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{NODE_NAME}={peer}",
            "--initial-cluster-state",
            "new",
            "--unsafe-no-fsync",  # a throwaway test cluster: skip fsync to start and write fast
            "--log-level",
            "warn",
        ]

    def _apiserver_args(self) -> list[str]:
        p = self.pki
        return [
            str(self._binary("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{ETCD_CLIENT_PORT}",
            "--bind-address=127.0.0.1",
            f"--secure-port={API_PORT}",
            "--advertise-address=127.0.0.1",
            # The "kubernetes" service cannot point at a loopback address; nothing here needs it to.
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={p / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            # Request-header (front proxy) authentication, which the scheduler and controller-manager look up.
            f"--requestheader-client-ca-file={p / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={p / 'front-proxy-client.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]

    def _controller_manager_args(self) -> list[str]:
        kc = str(self.state / "controller-manager.kubeconfig")
        return [
            str(self._binary("kube-controller-manager")),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            f"--service-account-private-key-file={self.pki / 'sa.key'}",
            f"--root-ca-file={self.pki / 'ca.crt'}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={self.pki / 'ca.crt'}",
            f"--cluster-signing-key-file={self.pki / 'ca.key'}",
            "--profiling=false",
            "--v=1",
        ]

    def _scheduler_args(self) -> list[str]:
        kc = str(self.state / "scheduler.kubeconfig")
        return [
            str(self._binary("kube-scheduler")),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ]

    def _kubelet_args(self) -> list[str]:
        return [
            str(self._binary("kubelet")),
            f"--config={self.state / 'kubelet.yaml'}",
            f"--kubeconfig={self.state / 'kubelet.kubeconfig'}",
            f"--root-dir={KUBELET_ROOT}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            "--v=2",
        ]

    def start_kubelet(self) -> None:
        """(Re)start the kubelet with the recorded configuration; for the kubelet-restart scenario."""
        self._start("kubelet", self._kubelet_args())

    def stop_kubelet(self) -> None:
        self._stop("kubelet", timeout=30)

    # -- readiness --------------------------------------------------------------------------------------------
    def _etcd_healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{ETCD_CLIENT_PORT}/health", timeout=2) as resp:
            return bool(json.load(resp).get("health") == "true")

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def _apiserver_ready(self) -> bool:
        url = f"https://127.0.0.1:{API_PORT}/readyz"
        with urllib.request.urlopen(url, timeout=2, context=self._ssl_context()) as resp:
            return bool(resp.status == 200)

    def _api(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request to the API server as the admin; raises urllib.error.HTTPError on an error status."""
        request = urllib.request.Request(
            f"https://127.0.0.1:{API_PORT}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10, context=self._ssl_context()) as resp:
            out: dict[str, Any] = json.load(resp)
            return out

    def _api_exists(self, path: str) -> bool:
        try:
            self._api("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return False
            raise
        return True

    def _create_default_service_account(self) -> bool:
        body = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
        try:
            self._api("POST", "/api/v1/namespaces/default/serviceaccounts", body)
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: it exists already
                raise
        return True

    def _scheduler_healthy(self) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # its self-signed serving certificate
        with urllib.request.urlopen(
            f"https://127.0.0.1:{KUBE_SCHEDULER_PORT}/healthz", timeout=2, context=ctx
        ) as r:
            return bool(r.status == 200)

    def _control_plane_ready(self) -> bool:
        try:
            return self._apiserver_ready()
        except OSError:  # refused, TLS, HTTP errors; certificates not made yet
            return False

    def _containerd_ready(self) -> bool:
        return self.containerd_sock.is_socket() and bool(self.ctr("version", check=False))

    def _node_ready(self) -> bool:
        if not self.kubeconfig.exists():
            return False
        node = self.kubectl_json("get", "node", NODE_NAME)
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _default_sa_ready(self) -> bool:
        self.kubectl("get", "serviceaccount", "default", "-n", "default")
        self.kubectl("get", "configmap", "kube-root-ca.crt", "-n", "default")
        return True

    def _images(self) -> None:
        """Write the pause and busybox OCI archives and import them into containerd's k8s.io namespace."""
        images = self.state / "images"
        oci.pause_image(images / "pause.tar", PAUSE_IMAGE, self.k8s_bin / "pause")
        oci.busybox_image(images / "busybox.tar", TEST_IMAGE)
        for tar in ("pause.tar", "busybox.tar"):
            self.ctr("images", "import", str(images / tar))
        listed = self.ctr("images", "ls", "-q")
        for ref in (PAUSE_IMAGE, TEST_IMAGE):
            if ref not in listed.split():
                raise ClusterError(f"image {ref} missing after import; containerd has: {listed.split()}")

    # -- down -------------------------------------------------------------------------------------------------
    def down(self) -> None:
        """Delete pods, stop what up started (only those PIDs), unmount and remove the state and kubelet root."""
        if not self.state.exists():
            log("nothing to tear down")
            return
        if self.control_plane_only:
            self._down_control_plane()
            return
        t0 = time.monotonic()
        if self.pid("kube-apiserver") and self.pid("kubelet") and self.kubeconfig.exists():
            # Let the kubelet stop the pods properly (CNI DEL, netns, volume unmounts).
            try:
                self.kubectl(
                    "delete",
                    "pods",
                    "--all",
                    "--all-namespaces",
                    "--wait=true",
                    "--timeout=90s",
                    "--grace-period=5",
                    check=False,
                    timeout=120,
                )
            except subprocess.TimeoutExpired:
                log("pods did not go away in time; stopping containers directly")
        self._stop("kubelet", timeout=30)
        if self.pid("containerd"):
            self._remove_containers()
        self._stop("containerd", timeout=30)
        self._kill_shims()
        for component in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            self._stop(component, timeout=30)
        try:
            names = set(json.loads((self.state / CREATED_FILE).read_text()))
        except (OSError, ValueError):
            names = set()
        created = {Path(p) for p in names if p.startswith("/")}
        if KUBEPODS in names:
            _remove_cgroups(KUBEPODS)
        if NODE_LINK in names:
            subprocess.run(["ip", "link", "delete", NODE_LINK], capture_output=True, check=False)
        _unmount_under(self.state)
        _unmount_under(KUBELET_ROOT)
        for d in (KUBELET_ROOT, CONTAINERD_RUN):
            if d in created or (d / OWNED_MARKER).exists():
                shutil.rmtree(d, ignore_errors=True)
        for d in created & set(CDI_DIRS):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: specs there are the daemon's, not ours
        if KUBELET_ROOT.exists():  # someone else's root: remove only what this kubelet left there
            for name in ("pods", "plugins", "plugins_registry", "pod-resources", "checkpoints"):
                shutil.rmtree(KUBELET_ROOT / name, ignore_errors=True)
            for name in KUBELET_STATE_FILES:
                (KUBELET_ROOT / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                (KUBELET_ROOT / "device-plugins").rmdir()  # when empty
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        shutil.rmtree(self.state, ignore_errors=True)
        if self.state.exists():
            raise ClusterError(
                f"could not remove {self.state}; still mounted: {list(_mounts_under(self.state))}"
            )
        log(f"down in {time.monotonic() - t0:.1f}s")

    def _down_control_plane(self) -> None:
        """Stop what up started (only those PIDs) and remove the state directory; nothing else was made."""
        t0 = time.monotonic()
        for component in reversed(CONTROL_PLANE):
            self._stop(component, timeout=30)
        shutil.rmtree(self.state, ignore_errors=True)
        if self.state.exists():
            raise ClusterError(f"could not remove {self.state}")
        log(f"down in {time.monotonic() - t0:.1f}s (control plane only)")

    def _stop(self, component: str, timeout: float) -> None:
        pid = self.pid(component)
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        if not _wait_exit(pid, timeout):
            log(f"{component} (pid {pid}) ignored SIGTERM for {timeout:.0f}s; killing")
            os.kill(pid, signal.SIGKILL)
            _wait_exit(pid, 10)
        self._pid_file(component).unlink(missing_ok=True)
        log(f"stopped {component} (pid {pid})")

    def _remove_containers(self) -> None:
        """Containers the kubelet did not stop: kill their tasks, free their network namespaces, delete them."""
        ids = self.ctr("containers", "ls", "-q", check=False).split()
        if not ids:
            return
        log(f"removing {len(ids)} leftover containers")
        netns: set[str] = set()
        for cid in ids:
            try:
                info = json.loads(self.ctr("containers", "info", cid))
                for ns in info.get("Spec", {}).get("linux", {}).get("namespaces", []):
                    if ns.get("type") == "network" and ns.get("path", "").startswith(
                        ("/var/run/netns/", "/run/netns/")
                    ):
                        netns.add(ns["path"])
            except (ClusterError, json.JSONDecodeError):
                pass
            self.ctr("tasks", "kill", "--signal", "SIGKILL", cid, check=False)
        for cid in ids:
            for _ in range(20):
                if (
                    "No such" in self.ctr("tasks", "delete", cid, check=False)
                    or cid not in self.ctr("tasks", "ls", "-q", check=False).split()
                ):
                    break
                time.sleep(0.25)
            self.ctr("containers", "delete", cid, check=False)
        for path in netns:
            subprocess.run(["umount", path], capture_output=True, check=False)
            Path(path).unlink(missing_ok=True)

    def _kill_shims(self) -> None:
        """Shims outlive containerd by design; kill the ones running our shim binary."""
        shim = str(self.containerd_bin / "containerd-shim-runc-v2")
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if os.readlink(proc / "exe").removesuffix(" (deleted)") == shim:
                    os.kill(int(proc.name), signal.SIGKILL)
                    log(f"killed leftover shim {proc.name}")
            except OSError:
                continue

    # -- status -----------------------------------------------------------------------------------------------
    def status(self) -> int:
        """Print component PIDs and node readiness; 0 when everything runs and the node is Ready."""
        if self.control_plane_only:
            return self._status_control_plane()
        running = self.running()
        for component, pid in running.items():
            print(f"{component:24} {'pid ' + str(pid) if pid else 'not running'}")
        ready = False
        with contextlib.suppress(ClusterError, subprocess.SubprocessError, OSError):
            ready = all(running.values()) and self._node_ready()
        print(
            f"node {NODE_NAME}: {'Ready' if ready else 'not ready'} (Kubernetes {self.release}, {self.k8s_bin})"
        )
        print(f"state {self.state}; logs {self.logs}; device plugins {DEVICE_PLUGIN_DIR}")
        return 0 if ready else 1

    def _status_control_plane(self) -> int:
        running = self.running()
        for component, pid in running.items():
            print(f"{component:24} {'pid ' + str(pid) if pid else 'not running'}")
        ready = all(running.values()) and self._control_plane_ready()
        print(f"control plane only (no node): {'ready' if ready else 'not ready'}")
        print(f"state {self.state}; logs {self.logs}")
        return 0 if ready else 1

    def env(self) -> str:
        return f"export KUBECONFIG={self.kubeconfig}\nexport PATH={self.k8s_bin}:$PATH\n"


# -- module helpers -------------------------------------------------------------------------------------------
def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"{argv[0]} {argv[1]} failed: {proc.stderr.strip()}")


def _openssl_conf(
    path: Path, cn: str, org: str | None, sans: list[str] | None = None, ca: bool = False
) -> None:
    lines = ["[req]", "distinguished_name = dn", "prompt = no", "[dn]", f"CN = {cn}"]
    if org:
        lines.append(f"O = {org}")
    lines.append("[ext]")
    if ca:
        lines += [
            "basicConstraints = critical,CA:TRUE",
            "keyUsage = critical,keyCertSign,cRLSign,digitalSignature",
            "subjectKeyIdentifier = hash",
        ]
    else:
        usage = "serverAuth,clientAuth" if sans else "clientAuth"
        lines += [
            "basicConstraints = critical,CA:FALSE",
            "keyUsage = critical,digitalSignature,keyEncipherment",
            f"extendedKeyUsage = {usage}",
            "authorityKeyIdentifier = keyid",
        ]
        if sans:
            lines.append("subjectAltName = " + ",".join(sans))
    path.write_text("\n".join(lines) + "\n")


def _wait_exit(pid: int, timeout: float) -> bool:
    """Wait for a process that may not be our child to exit (zombies count as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.1)
    return False


def _mounts_under(root: Path) -> Iterator[str]:
    """Mount points at or below ``root`` from /proc/self/mountinfo, deepest first."""
    prefix = str(root).rstrip("/") + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")  # octal escapes such as \040
        if point == str(root) or point.startswith(prefix):
            points.append(point)
    yield from sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def _unmount_under(root: Path) -> None:
    for _ in range(3):  # stacked mounts need more than one pass
        points = list(_mounts_under(root))
        if not points:
            return
        for point in points:
            if subprocess.run(["umount", point], capture_output=True, check=False).returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def _listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)  # CAP_SYS_RESOURCE = 24
    return False


def _remove_cgroups(name: str) -> None:
    """Remove a cgroup subtree from every v1 hierarchy, leaves first (only empty cgroups can go)."""
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: w[0].count("/"), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def tail_file(path: Path, lines: int = 60) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * lines))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<{path}: {exc}>"


@contextlib.contextmanager
def exclusive(wait: float, purpose: str) -> Iterator[None]:
    """Hold the cluster lock; wait up to ``wait`` seconds for another holder, then raise naming it."""
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with LOCK_FILE.open("a+") as f:
        deadline = time.monotonic() + wait
        announced = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                if time.monotonic() >= deadline:
                    raise ClusterError(f"the e2e cluster is in use by {holder} ({LOCK_FILE})") from None
                if not announced:
                    log(f"waiting up to {wait:.0f}s for {holder} to finish with the cluster")
                    announced = True
                time.sleep(1)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} ({purpose})\n")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def held_up(cluster: Cluster, wait: float, purpose: str) -> Iterator[Cluster]:
    """The cluster lock held and the cluster up, with ``KUBECONFIG`` pointing at it (a benchmark's whole run):
    one already running is reused and left running, else it is brought up here and down at the end."""
    with exclusive(wait, purpose):
        reuse = cluster.state.exists() and all(cluster.running().values())
        if not reuse:
            cluster.up()
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        try:
            yield cluster
        finally:
            if not reuse:
                cluster.down()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument(
        "--control-plane-only",
        action="store_true",
        help="etcd, kube-apiserver, kube-scheduler (+ kube-controller-manager if built): no node, for API-only "
        "Node objects; its own state directory (KXPU_E2E_CP_STATE)",
    )
    args = parser.parse_args(argv)
    cluster = Cluster.default(control_plane_only=args.control_plane_only)
    try:
        if args.command in ("up", "down"):
            with exclusive(wait=0, purpose=f"e2e.cluster {args.command}"):
                if args.command == "up":
                    cluster.up()
                else:
                    cluster.down()
        elif args.command == "status":
            return cluster.status()
        else:
            print(cluster.env(), end="")
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.command == "up":
            flag = " --control-plane-only" if args.control_plane_only else ""
            print(f"logs: {cluster.logs}; clean up with: python3 -m e2e.cluster down{flag}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
