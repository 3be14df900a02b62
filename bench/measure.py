"""What every benchmark measures the same way: percentiles, and a process's memory and CPU time."""

from __future__ import annotations

import os
from pathlib import Path


def percentile(samples: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0-100) of ``samples``."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def rss_mb(pid: int) -> float:
    """Resident set size of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
