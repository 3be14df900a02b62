"""What every benchmark measures the same way: percentiles, and a process's memory and CPU time."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path


def compile_tree(python: Path | str, tree: Path) -> None:
    """Bytecode for ``tree``'s modules (kxpu and bench), as the image and the dev install ship it, before a start-up
    is timed: an edited tree, or one run with PYTHONDONTWRITEBYTECODE, would otherwise compile its changed modules
    from source at every start, and that is what would be measured."""
    for folder in ("kxpu", "bench"):
        command = [str(python), "-m", "compileall", "-q", str(tree / folder)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


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


def thread_cpu_seconds(pid: int) -> float:
    """Time on a CPU of every thread the process has now (schedstat: nanoseconds, where /proc's stat counts
    10 ms ticks, too coarse for a batch of calls of a fraction of a millisecond each)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total / 1e9


async def idle_cpu_percent(pid: int, seconds: float) -> float:
    """CPU a process uses while nothing is asked of it, as a percentage of one core."""
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)  # measuring idleness: nothing may happen meanwhile
    return 100 * (cpu_seconds(pid) - before) / seconds


def report(title: str, results: dict[str, float], targets: dict[str, float], as_json: bool) -> None:
    """A Markdown table of the figures against their upper-bound targets (✓/✗), optionally JSON too."""
    print(f"{title}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}\n")
    print("| measure | value | target |\n|---|---|---|")
    for key, value in results.items():
        target = targets.get(key)
        verdict = "" if target is None else f"≤ {target:g}" + (" ✓" if value <= target else " ✗")
        print(f"| {key} | {value:.2f} | {verdict} |")
    if as_json:
        print(json.dumps(results, indent=2))
