"""One user of the cluster at a time: an e2e session holds this lock from start to end (its scenarios restart
the kubelet, which another session would take for a dead cluster); up and down take it too, and a benchmark
holds it for its whole run (``held_up``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from e2e.cluster.base import ClusterError, log

if TYPE_CHECKING:
    from e2e.cluster.core import Cluster

LOCK_FILE = Path("/run/kxpu-e2e.lock")


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
