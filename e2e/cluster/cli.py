"""``python -m e2e.cluster up|down|status|env [--control-plane-only]`` (``make cluster-up``/``cluster-down``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from e2e.cluster.base import ClusterError
from e2e.cluster.core import Cluster
from e2e.cluster.lock import exclusive


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.cluster",
        description="A real single-node Kubernetes cluster on this host, for the e2e tests.",
    )
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
