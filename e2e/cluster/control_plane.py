"""The control-plane-only mode (``--control-plane-only``): etcd, kube-apiserver and kube-scheduler, plus
kube-controller-manager where its binary exists; no node, for work on API-only Node objects
(``bench/bench_sharing_e2e.py``). Its own state directory, the same ports as the normal mode."""

from __future__ import annotations

import os
import shutil
import time

from e2e.cluster.base import ClusterError, log, wait_for
from e2e.cluster.builds import K8S_BIN_ENV
from e2e.cluster.components import Components, _listening
from e2e.cluster.credentials import Credentials
from e2e.cluster.layout import API_PORT, CONTROL_PLANE, ETCD_CLIENT_PORT, ETCD_PEER_PORT


class ControlPlaneOnly(Credentials, Components):
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

    def _down_control_plane(self) -> None:
        """Stop what up started (only those PIDs) and remove the state directory; nothing else was made."""
        t0 = time.monotonic()
        for component in reversed(CONTROL_PLANE):
            self._stop(component, timeout=30)
        shutil.rmtree(self.state, ignore_errors=True)
        if self.state.exists():
            raise ClusterError(f"could not remove {self.state}")
        log(f"down in {time.monotonic() - t0:.1f}s (control plane only)")

    def _status_control_plane(self) -> int:
        running = self.running()
        for component, pid in running.items():
            print(f"{component:24} {'pid ' + str(pid) if pid else 'not running'}")
        ready = all(running.values()) and self._control_plane_ready()
        print(f"control plane only (no node): {'ready' if ready else 'not ready'}")
        print(f"state {self.state}; logs {self.logs}")
        return 0 if ready else 1
