"""``Cluster``: one e2e cluster instance, joined from the harness's parts (the credentials it makes, the
components it runs, the node half of the normal mode, the control-plane-only mode), and its life as a
whole: ``up``, ``down``, ``status``, ``env``."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time

from e2e.cluster.base import ClusterError, log, wait_for
from e2e.cluster.control_plane import ControlPlaneOnly
from e2e.cluster.layout import CNI_BIN_DIR, COMPONENTS, DEVICE_PLUGIN_DIR, NODE_NAME, RUNC
from e2e.cluster.node import NodeHost, _mounts_under


class Cluster(ControlPlaneOnly, NodeHost):
    """Paths of one cluster instance; every method is safe to call whether or not it is up."""

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
        self._remove_host_state()
        shutil.rmtree(self.state, ignore_errors=True)
        if self.state.exists():
            raise ClusterError(
                f"could not remove {self.state}; still mounted: {list(_mounts_under(self.state))}"
            )
        log(f"down in {time.monotonic() - t0:.1f}s")

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

    def env(self) -> str:
        return f"export KUBECONFIG={self.kubeconfig}\nexport PATH={self.k8s_bin}:$PATH\n"
