"""Unix-socket facts both node servers (the device plugin and the DRA driver) need."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

# sockaddr_un holds 108 bytes including the terminating NUL; the kubelet dials the same path.
MAX_SOCKET_PATH = 107


def live_socket(path: Path) -> bool:
    """Someone accepts connections there (a stale file from a killed process refuses them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            return True  # backlog full: alive, just busy
        except OSError as exc:
            # Refused or gone: nobody there. Anything else (EACCES: another user's socket) is not ours to call dead.
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
        return True
