"""NVIDIA MPS: one control daemon per shared GPU, started, supervised and stopped by the backend.

Facts kxpu relies on (NVIDIA's MPS documentation and k8s-device-plugin's ``cmd/mps-control-daemon``):

- ``nvidia-cuda-mps-control -d`` starts the control daemon in the background. It and its clients
  find each other through ``CUDA_MPS_PIPE_DIRECTORY``; it logs to ``CUDA_MPS_LOG_DIRECTORY``
  (``control.log``) and writes its PID to ``nvidia-cuda-mps-control.pid`` in the pipe directory.
- With ``CUDA_VISIBLE_DEVICES=<uuid>`` in its environment it serves that GPU only, which the MPS
  server presents to clients as device 0. kxpu runs one daemon per GPU for that reason: a container
  reaches exactly the GPU it was given (one daemon for several GPUs lets a client use them all), and a
  dead daemon takes down only its GPU's replicas.
- Without arguments the program is a front-end that reads commands from stdin. kxpu sends
  ``set_default_device_pinned_mem_limit 0 <N>M`` and ``set_default_active_thread_percentage <p>``
  (NVIDIA's plugin: memory / replicas, 100 / replicas; they apply to servers started afterwards) and
  ``quit``. A rejected command still exits 0 with a message on stdout, so answers are checked.
- A client's ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``0=<N>M``: NVIDIA's plugin sets limits by device
  index because limits given by UUID were not applied) and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` can
  only lower what the daemon's defaults allow.
- Clients need the pipe directory and the server's ``/dev/shm``: NVIDIA mounts ``<mpsRoot>/shm`` at
  ``/dev/shm`` in the daemon's container and in every client container, and the pipe directory at
  ``/mps/<resource>/pipe``; kxpu mounts ``/mps/<gpu-uuid>/pipe``.

Supervision polls each daemon's PID (no process is started to do it) every ``checkInterval``: a daemon
that is gone is reported down at once (its replicas turn unhealthy) and started again with backoff.
A daemon found running at start (left by an earlier kxpu) is adopted rather than started twice.
Stopping sends ``quit``, which lets running clients finish: a daemon that outlives the stop timeout is
left to exit when they do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kxpu.logs import get_logger

log = get_logger("kxpu.backends.nvidia.mps")

CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
PINNED_MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
CONTAINER_ROOT = "/mps"
CONTAINER_SHM = "/dev/shm"
COMMAND_TIMEOUT_S = 10.0
# Unix socket paths hold 107 bytes; the daemon and its servers make sockets in the pipe directory.
MAX_PIPE_DIR_BYTES = 80
MAX_RESTART_BACKOFF_S = 30.0
# Where a containerised driver keeps its libraries (the GPU Operator's /run/nvidia/driver layout).
_DRIVER_LIB_DIRS = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu")


class MpsError(Exception):
    """MPS cannot run as configured; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class MpsLimits:
    """A daemon's defaults: the ceiling for every client of the servers it starts (None: no limit)."""

    memory_mib: int | None = None
    thread_percentage: int | None = None


def control_binary(driver_root: Path) -> Path:
    return driver_root / "usr" / "bin" / CONTROL_BINARY


def max_clients(compute_capability: tuple[int, int] | None) -> int:
    """Clients one MPS server takes: 48 from compute capability 7.5 on, else 16 (NVIDIA's plugin's check)."""
    return 48 if compute_capability is not None and compute_capability >= (7, 5) else 16


def _same_directory(a: Path, b: Path) -> bool:
    try:
        sa, sb = a.stat(), b.stat()
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_shm(shm_dir: Path, own_shm: Path = Path(CONTAINER_SHM)) -> None:
    """The MPS server (started by the daemon, in this process's mount namespace) shares memory with its
    clients through /dev/shm; clients get ``shm_dir`` there, so ours must be the same directory."""
    if not shm_dir.is_dir():
        raise MpsError(f"MPS shared memory directory {shm_dir} does not exist (mps.shmDir)")
    if not _same_directory(own_shm, shm_dir):
        raise MpsError(
            f"this process's {own_shm} is not {shm_dir}, which containers get as /dev/shm: MPS clients could "
            f"not reach the server. Mount {shm_dir} at {own_shm} in kxpu's container (the Helm chart does), "
            f"or set mps.shmDir: {own_shm} when kxpu runs on the host"
        )


class MpsDaemon:
    """The control daemon of one GPU: its directories, its commands, its process."""

    def __init__(
        self,
        uuid: str,
        root: Path,
        binary: Path,
        limits: MpsLimits,
        environ: Mapping[str, str],
        start_timeout_s: float = 10.0,
    ) -> None:
        self.uuid = uuid
        self.root = root / uuid
        self.binary = binary
        self.limits = limits
        self.start_timeout_s = start_timeout_s
        self.pipe_dir = self.root / "pipe"
        self.log_dir = self.root / "log"
        self.env = {**environ, PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}
        self.up = False
        self.adopted = False
        self.failures = 0
        self.retry_at = 0.0

    @property
    def container_pipe_dir(self) -> str:
        return f"{CONTAINER_ROOT}/{self.uuid}/pipe"

    # ------------------------------------------------------------------ the process
    def pid(self) -> int | None:
        """The daemon's PID if it is running (its PID file names a live control daemon), else None."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            return None
        if state == "Z":  # exited; reap it if it became our child (kxpu as a container's PID 1)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            return None
        return pid if CONTROL_BINARY.encode() in argv else None

    def start(self) -> None:
        """Start (or adopt) the daemon and apply its defaults; MpsError says why it could not."""
        if len(str(self.pipe_dir).encode()) > MAX_PIPE_DIR_BYTES:
            raise MpsError(
                f"the MPS pipe directory {self.pipe_dir} is {len(str(self.pipe_dir).encode())} bytes long; the "
                f"sockets MPS makes there need it under {MAX_PIPE_DIR_BYTES}: use a shorter mpsRoot"
            )
        for directory in (self.pipe_dir, self.log_dir):
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise MpsError(f"cannot create the MPS directory {directory}: {exc.strerror}") from None
        running = self.pid()
        self.adopted = running is not None
        if running is None:
            with contextlib.suppress(FileNotFoundError):
                (self.pipe_dir / PID_FILE).unlink()  # a stale one from a daemon that was killed
            self._spawn()
        try:
            self._configure()
        except MpsError:
            if not self.adopted:
                self._discard()  # never handed to a container: leave nothing running that we started
            raise
        self.up = True
        self.failures = 0
        log.info(
            "MPS control daemon running",
            gpu=self.uuid,
            pid=self.pid(),
            adopted=self.adopted,
            pipe=str(self.pipe_dir),
            memory_limit_mib=self.limits.memory_mib,
            thread_percentage=self.limits.thread_percentage,
        )

    def _spawn(self) -> None:
        with tempfile.TemporaryFile() as output:  # not a pipe: the daemon may keep it open
            try:
                result = subprocess.run(
                    [str(self.binary), "-d"],
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    timeout=self.start_timeout_s,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise MpsError(f"GPU {self.uuid}: cannot run {self.binary} -d: {exc}") from None
            output.seek(0)
            said = output.read().decode(errors="replace").strip()
        if result.returncode != 0:
            raise MpsError(
                f"GPU {self.uuid}: {self.binary} -d exited with status {result.returncode}"
                + (f": {said}" if said else "")
                + f" (see {self.log_dir / 'control.log'})"
            )
        deadline = time.monotonic() + self.start_timeout_s
        while self.pid() is None:
            if time.monotonic() > deadline:
                raise MpsError(
                    f"GPU {self.uuid}: the MPS control daemon did not write {self.pipe_dir / PID_FILE} within "
                    f"{self.start_timeout_s:g}s (see {self.log_dir / 'control.log'})"
                )
            time.sleep(0.02)

    def command(self, line: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Send one command through the front-end; its answer, stripped. MpsError if the daemon is unreachable."""
        try:
            result = subprocess.run(
                [str(self.binary)],
                input=line + "\n",
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"GPU {self.uuid}: MPS command {line!r} failed: {exc}") from None
        if result.returncode != 0:
            said = (result.stderr or result.stdout).strip()
            raise MpsError(
                f"GPU {self.uuid}: MPS command {line!r} failed with status {result.returncode}"
                + (f": {said}" if said else "")
            )
        return result.stdout.strip()

    def _configure(self) -> None:
        """Apply the defaults, retrying while a just-started daemon does not listen yet."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                self.command("get_default_active_thread_percentage")
                break
            except MpsError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if self.limits.memory_mib is not None:
            line = f"set_default_device_pinned_mem_limit 0 {self.limits.memory_mib}M"
            answer = self.command(line)
            if answer:  # silent when accepted
                raise MpsError(f"GPU {self.uuid}: the MPS daemon refused {line!r}: {answer}")
        if self.limits.thread_percentage is not None:
            line = f"set_default_active_thread_percentage {self.limits.thread_percentage}"
            answer = self.command(line)
            try:
                accepted = float(answer) == float(self.limits.thread_percentage)
            except ValueError:
                accepted = False
            if not accepted:
                raise MpsError(f"GPU {self.uuid}: the MPS daemon refused {line!r}: {answer or 'no answer'}")

    def _discard(self) -> None:
        """End a daemon this start spawned but could not configure: quit, else SIGTERM, else SIGKILL."""
        if self.stop(1.0):
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pid = self.pid()
            if pid is None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + 2.0
            while self.pid() is not None and time.monotonic() < deadline:
                time.sleep(0.02)

    def stop(self, timeout_s: float) -> bool:
        """``quit``; True once the daemon is gone, False if it still waits for clients after ``timeout_s``."""
        self.up = False
        if self.pid() is None:
            return True
        try:
            self.command("quit")
        except MpsError as exc:
            log.warning("could not ask the MPS control daemon to quit", gpu=self.uuid, error=str(exc))
        deadline = time.monotonic() + timeout_s
        while self.pid() is not None:
            if time.monotonic() > deadline:
                log.warning(
                    "MPS control daemon still running after quit; it exits once its clients finish",
                    gpu=self.uuid,
                    pid=self.pid(),
                )
                return False
            time.sleep(0.02)
        log.info("MPS control daemon stopped", gpu=self.uuid)
        return True


def daemon_environ(driver_root: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a control daemon starts with: ours, with a containerised driver's programs and
    libraries found first when the driver root is not /."""
    env = dict(os.environ if base is None else base)
    if driver_root != Path("/"):
        env["PATH"] = os.pathsep.join([str(driver_root / "usr" / "bin"), env.get("PATH", "/usr/bin:/bin")])
        libs = [str(driver_root / d) for d in _DRIVER_LIB_DIRS if (driver_root / d).is_dir()]
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return env


class MpsManager:
    """Every shared GPU's daemon, and the thread that keeps them running."""

    def __init__(
        self,
        daemons: Sequence[MpsDaemon],
        on_change: Callable[[], None],
        check_interval_s: float = 1.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.daemons = {d.uuid: d for d in daemons}
        self.on_change = on_change
        self.check_interval_s = check_interval_s
        self.stop_timeout_s = stop_timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start every daemon, side by side (raising the first MpsError, with the daemons this call started
        stopped again), then supervise."""
        errors: list[MpsError] = []

        def start_one(daemon: MpsDaemon) -> None:
            try:
                daemon.start()
            except MpsError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start_one, args=(d,), daemon=True) for d in self.daemons.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            for daemon in self.daemons.values():
                if daemon.up and not daemon.adopted:
                    daemon.stop(self.stop_timeout_s)
            raise errors[0]
        self._thread = threading.Thread(target=self._supervise, name="kxpu-nvidia-mps", daemon=True)
        self._thread.start()

    def down(self) -> set[str]:
        """UUIDs of the GPUs whose daemon is not running now."""
        with self._lock:
            return {uuid for uuid, d in self.daemons.items() if not d.up}

    def daemon(self, uuid: str) -> MpsDaemon | None:
        return self.daemons.get(uuid)

    def _supervise(self) -> None:
        while not self._stop.wait(self.check_interval_s):
            changed = False
            for daemon in self.daemons.values():
                try:
                    changed |= self._check(daemon)
                except Exception as exc:  # never let one daemon's trouble end supervision
                    log.error("MPS supervision failed for a GPU", gpu=daemon.uuid, error=f"{exc!r}")
            if changed and not self._stop.is_set():
                self.on_change()

    def _check(self, daemon: MpsDaemon) -> bool:
        if daemon.up:
            if daemon.pid() is not None:
                return False
            with self._lock:
                daemon.up = False
            # Report it down first and restart on the next check: the kubelet sees the devices
            # unhealthy (their clients lost the server) rather than a flicker it might coalesce away.
            daemon.retry_at = time.monotonic() + self.check_interval_s
            log.error(
                "MPS control daemon died; its GPU's devices are unhealthy until it runs again",
                gpu=daemon.uuid,
            )
            return True
        if time.monotonic() < daemon.retry_at or self._stop.is_set():
            return False
        return self._restart(daemon)

    def _restart(self, daemon: MpsDaemon) -> bool:
        try:
            daemon.start()
        except MpsError as exc:
            daemon.failures += 1
            delay = min(MAX_RESTART_BACKOFF_S, 0.5 * 2 ** (daemon.failures - 1))
            daemon.retry_at = time.monotonic() + delay
            daemon.up = False
            log.warning(
                "MPS control daemon not running; retrying", gpu=daemon.uuid, error=str(exc), retry_in_s=delay
            )
            return False
        log.info("MPS control daemon running again", gpu=daemon.uuid)
        return True

    def stop(self) -> set[str]:
        """Stop supervising and quit every daemon; returns the GPUs whose daemon has exited."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.check_interval_s + 2 * COMMAND_TIMEOUT_S)
        return {uuid for uuid, d in self.daemons.items() if d.stop(self.stop_timeout_s)}
