"""The kubelet-facing node daemon. It knows the device model and the config, never a vendor."""

from kxpu.daemon.daemon import Daemon
from kxpu.daemon.resource import Phase, ResourceRunner, check_socket_paths, socket_name

__all__ = ["Daemon", "Phase", "ResourceRunner", "check_socket_paths", "socket_name"]
