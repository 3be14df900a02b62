"""Where the e2e cluster lives on this host: its node, addresses, ports, directories, images, and which
components each mode runs. Constants only."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

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

# Start order; down stops them in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "containerd", "kubelet")
# The control-plane-only mode: these (kube-controller-manager only where its binary exists).
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
OPTIONAL_CONTROL_PLANE = ("kube-controller-manager",)
