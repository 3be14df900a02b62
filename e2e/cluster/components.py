"""The cluster's processes: each component's command line, start (detached, its PID and executable
recorded), stop (only a recorded PID, SIGTERM then SIGKILL), and the checks that say it is ready."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from e2e.cluster.base import ClusterBase, log
from e2e.cluster.layout import (
    API_PORT,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    KUBE_SCHEDULER_PORT,
    KUBELET_ROOT,
    NODE_IP,
    NODE_NAME,
    SERVICE_CIDR,
)


class Components(ClusterBase):
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


def _listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0
