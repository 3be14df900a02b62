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

Where each part lives (scenarios import from ``e2e.cluster`` itself):

- ``layout.py``: the node's name and address, ports, CIDRs, host directories, images, each mode's components;
- ``builds.py``: which binaries (build.sh's cache or ``KXPU_K8S_BIN``) and each mode's state directory;
- ``base.py``: ``ClusterError``, ``wait_for``, ``tail_file``; a cluster's paths, ``kubectl``, ``ctr``, ``pid``;
- ``credentials.py``: the CA, certificates (``issue_certificate``), the service-account key, kubeconfigs;
- ``components.py``: each component's command line, start/stop by recorded PID, readiness checks,
  ``start_kubelet``/``stop_kubelet``;
- ``node.py``: the normal mode's node half: host directories, containerd/CNI/kubelet configs, images,
  clean-up of containers, shims, mounts and cgroups;
- ``control_plane.py``: the ``--control-plane-only`` mode;
- ``core.py``: ``Cluster``, joining the above: ``up``, ``down``, ``status``, ``env``;
- ``lock.py``: the one-user-at-a-time lock (``exclusive``) and ``held_up`` for benchmarks;
- ``cli.py`` / ``__main__.py``: ``python -m e2e.cluster``.
"""

from e2e.cluster.base import ClusterError, log, tail_file, wait_for
from e2e.cluster.builds import BUILD_SCRIPT, K8S_BIN_ENV, build_paths, state_dir
from e2e.cluster.cli import main
from e2e.cluster.core import Cluster
from e2e.cluster.layout import (
    API_PORT,
    CDI_DIRS,
    COMPONENTS,
    CONTROL_PLANE,
    DEVICE_PLUGIN_DIR,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    KUBE_SCHEDULER_PORT,
    KUBELET_ROOT,
    NODE_IP,
    NODE_NAME,
    PAUSE_IMAGE,
    POD_SUBNET,
    REPO,
    SERVICE_CIDR,
    SERVICE_IP,
    TEST_IMAGE,
)
from e2e.cluster.lock import LOCK_FILE, exclusive, held_up

__all__ = [
    "API_PORT",
    "BUILD_SCRIPT",
    "CDI_DIRS",
    "COMPONENTS",
    "CONTROL_PLANE",
    "DEVICE_PLUGIN_DIR",
    "ETCD_CLIENT_PORT",
    "ETCD_PEER_PORT",
    "K8S_BIN_ENV",
    "KUBELET_ROOT",
    "KUBE_SCHEDULER_PORT",
    "LOCK_FILE",
    "NODE_IP",
    "NODE_NAME",
    "PAUSE_IMAGE",
    "POD_SUBNET",
    "REPO",
    "SERVICE_CIDR",
    "SERVICE_IP",
    "TEST_IMAGE",
    "Cluster",
    "ClusterError",
    "build_paths",
    "exclusive",
    "held_up",
    "log",
    "main",
    "state_dir",
    "tail_file",
    "wait_for",
]
