"""The node half of the normal mode, outside the control plane: host directories (the kubelet's root,
containerd's run directory, the CDI directories; only the ones it made are removed), the node's bridge,
containerd's, CNI's and the kubelet's configs, the local images, and the clean-up of what containers and
mounts leave behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from e2e import oci
from e2e.cluster.base import ClusterError, _run, log
from e2e.cluster.components import Components
from e2e.cluster.layout import (
    BRIDGE,
    CDI_DIRS,
    CGROUP_ROOT,
    CNI_BIN_DIR,
    CONTAINERD_RUN,
    CREATED_FILE,
    HOST_DIRS,
    KUBELET_ROOT,
    KUBELET_STATE_FILES,
    KUBEPODS,
    NODE_IP,
    NODE_LINK,
    OWNED_MARKER,
    PAUSE_IMAGE,
    POD_SUBNET,
    RUNC,
    SERVICE_CIDR,
    TEST_IMAGE,
)


class NodeHost(Components):
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

    def _remove_host_state(self) -> None:
        """Undo _make_host_dirs once everything is stopped: the cgroups, link, mounts and directories it made,
        and in a kubelet root that is not ours only what this kubelet left there."""
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
