"""A stand-in for the driver's ``nvidia-cuda-mps-control``, for tests without a GPU.

``install(driver_root)`` puts an executable ``<driver_root>/usr/bin/nvidia-cuda-mps-control`` that
behaves as the real program does in what kxpu relies on, and records what it was asked:

- ``-d`` starts the control daemon in the background (the command returns once it listens), ``-f``
  in the foreground. The daemon reads ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``) and
  ``CUDA_MPS_LOG_DIRECTORY`` (default ``/var/log/nvidia-mps``), writes its PID to
  ``nvidia-cuda-mps-control.pid`` in the pipe directory, listens on the ``control`` socket there,
  logs to ``control.log`` in the log directory, and refuses to start while another daemon's PID file
  names a live process.
- Without arguments it is the front-end: it reads commands from stdin, one per line, sends them to
  the daemon of ``CUDA_MPS_PIPE_DIRECTORY`` and prints the answers; its exit status is non-zero only
  when it cannot reach the daemon (a rejected command is answered with a message, status 0, as the
  man page says).
- Commands: ``get_default_active_thread_percentage``, ``set_default_active_thread_percentage <p>``
  (answers the value, e.g. ``50.0``), ``set_default_device_pinned_mem_limit <dev> <value>``
  (silent; values like ``4096M`` or ``2G``), ``get_default_device_pinned_mem_limit <dev>``,
  ``get_server_list`` and ``quit``.

Every start, command and stop is appended as a JSON line to ``kxpu-fake-mps.jsonl`` in the log
directory (``read_record``), with the environment that matters (``CUDA_VISIBLE_DEVICES`` and the
two directories). ``KXPU_FAKE_MPS_FAIL=start`` in the environment makes the daemon refuse to start,
``=commands`` makes it reject every command, ``=linger`` makes it stay after ``quit`` (as the real
daemon does while clients are still connected). ``KXPU_FAKE_MPS_FAIL_FILE=<path>`` does the same with
the mode read from that file while it exists, so a test can make restarts fail for a while. This file imports only the standard library: the
installed program runs it directly, so each call costs a bare interpreter start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"
CONTROL_LOG = "control.log"
RECORD_FILE = "kxpu-fake-mps.jsonl"
FAIL_ENV = "KXPU_FAKE_MPS_FAIL"
FAIL_FILE_ENV = "KXPU_FAKE_MPS_FAIL_FILE"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
DEFAULT_LOG_DIR = "/var/log/nvidia-mps"
_MEMORY_VALUE = re.compile(r"^\d+(\.\d+)?[KMGT]?$")


def install(driver_root: Path) -> Path:
    """Write the stand-in as ``<driver_root>/usr/bin/nvidia-cuda-mps-control``; returns its path."""
    target = driver_root / "usr" / "bin" / BINARY
    target.parent.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).resolve()
    target.write_text(
        f"#!{sys.executable} -I\nimport runpy\nrunpy.run_path({str(source)!r}, run_name='__main__')\n"
    )
    target.chmod(0o755)
    return target


def read_record(log_dir: Path) -> list[dict[str, Any]]:
    """What every stand-in daemon that used ``log_dir`` recorded, oldest first."""
    try:
        lines = (log_dir / RECORD_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def commands(log_dir: Path) -> list[str]:
    return [r["command"] for r in read_record(log_dir) if r["event"] == "command"]


def _dirs() -> tuple[Path, Path]:
    return (
        Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR),
        Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIR),
    )


def _fault() -> str:
    """The fault asked for: the env var, else the contents of the fail file while it exists."""
    mode = os.environ.get(FAIL_ENV, "")
    path = os.environ.get(FAIL_FILE_ENV)
    if not mode and path:
        with contextlib.suppress(OSError):
            mode = Path(path).read_text().strip()
    return mode


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read()
    except OSError:
        return False
    return state != "Z" and BINARY.encode() in argv


class _Daemon:
    def __init__(self, pipe_dir: Path, log_dir: Path) -> None:
        self.pipe_dir, self.log_dir = pipe_dir, log_dir
        self.thread_percentage = 100.0
        self.pinned: dict[str, str] = {}
        self.reject = _fault() == "commands"
        self.running = True

    def record(self, event: str, **fields: Any) -> None:
        entry = {"time": time.time(), "pid": os.getpid(), "event": event, **fields}
        with open(self.log_dir / RECORD_FILE, "a") as out:
            out.write(json.dumps(entry) + "\n")

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(self.log_dir / CONTROL_LOG, "a") as out:
            out.write(f"[{stamp}.{int(time.time() * 1000) % 1000:03d} Control {os.getpid()}] {message}\n")

    def prepare(self) -> socket.socket:
        """Everything that can fail at start; raises SystemExit with the message."""
        if _fault() == "start":
            raise SystemExit("MPS control daemon failed to start (KXPU_FAKE_MPS_FAIL=start)")
        pid_file = self.pipe_dir / PID_FILE
        try:
            other = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            other = 0
        if other and other != os.getpid() and _alive(other):
            raise SystemExit("An instance of this daemon is already running")
        for directory in (self.pipe_dir, self.log_dir):
            if not directory.is_dir():
                raise SystemExit(f"{directory} is not a directory")
        path = self.pipe_dir / CONTROL_SOCKET
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(str(path))
            server.listen(16)
            pid_file.write_text(f"{os.getpid()}\n")
        except OSError as exc:
            server.close()
            raise SystemExit(f"cannot listen on {path}: {exc}") from None
        self.log(f"Starting control daemon using socket {path}")
        self.record(
            "start",
            argv=sys.argv[1:],
            env={
                k: os.environ.get(k)
                for k in ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
            },
        )
        return server

    def serve(self, server: socket.socket) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        try:
            while self.running:
                try:
                    conn, _ = server.accept()
                except OSError:
                    break
                with conn:
                    self.session(conn)
        finally:
            self.cleanup(server)

    def stop(self) -> None:
        self.running = False
        raise SystemExit(0)

    def cleanup(self, server: socket.socket) -> None:
        server.close()
        for name in (CONTROL_SOCKET, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.pipe_dir / name).unlink()
        self.log("Exit")
        self.record("exit")

    def session(self, conn: socket.socket) -> None:
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        self.log("Accepting connection...")
        replies = []
        for line in data.decode(errors="replace").splitlines():
            command = line.strip()
            if not command:
                continue
            self.log(f"User did send {command}")
            reply = self.answer(command)
            self.record("command", command=command, reply=reply)
            if reply:
                replies.append(reply)
        conn.sendall("".join(r + "\n" for r in replies).encode())
        if not self.running:
            conn.close()
            raise SystemExit(0)

    def answer(self, command: str) -> str:
        if self.reject:
            return f"Invalid command {command!r} (KXPU_FAKE_MPS_FAIL=commands)"
        words = command.split()
        verb, args = words[0], words[1:]
        if verb == "get_default_active_thread_percentage" and not args:
            return f"{self.thread_percentage:.1f}"
        if verb == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                value = float(args[0])
            except ValueError:
                value = -1.0
            if not 0 < value <= 100:
                return f"Invalid active thread percentage {args[0]}"
            self.thread_percentage = value
            return f"{value:.1f}"
        if verb == "set_default_device_pinned_mem_limit" and len(args) == 2:
            if not _MEMORY_VALUE.match(args[1]):
                return f"Invalid memory limit {args[1]}"
            self.pinned[args[0]] = args[1]
            return ""
        if verb == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.pinned.get(args[0], "0")
        if verb == "get_server_list" and not args:
            return ""
        if verb == "quit":
            self.running = _fault() == "linger"  # still serving its clients
            return ""
        return f"Invalid command {command}"


def _foreground() -> int:
    pipe_dir, log_dir = _dirs()
    daemon = _Daemon(pipe_dir, log_dir)
    try:
        server = daemon.prepare()
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 1
    with contextlib.suppress(SystemExit):
        daemon.serve(server)
    return 0


def _background() -> int:
    """Fork twice so the daemon is nobody's child; the first process returns once it listens."""
    read_end, write_end = os.pipe()
    if os.fork() > 0:
        os.close(write_end)
        with os.fdopen(read_end) as ready:
            outcome = ready.read()
        if outcome != "ok":
            print(outcome or "MPS control daemon exited before it was ready", file=sys.stderr)
            return 1
        return 0
    os.close(read_end)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    pipe_dir, log_dir = _dirs()
    daemon = _Daemon(pipe_dir, log_dir)
    try:
        server = daemon.prepare()
    except SystemExit as exc:
        os.write(write_end, str(exc).encode())
        os._exit(1)
    os.write(write_end, b"ok")
    os.close(write_end)
    with contextlib.suppress(SystemExit):
        daemon.serve(server)
    os._exit(0)


def _front_end() -> int:
    pipe_dir, _ = _dirs()
    data = sys.stdin.read()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(pipe_dir / CONTROL_SOCKET))
            conn.sendall(data.encode())
            conn.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
    except OSError as exc:
        print(f"Cannot find MPS control daemon process ({exc})", file=sys.stderr)
        return 1
    sys.stdout.write(reply.decode())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["-d"]:
        return _background()
    if args == ["-f"]:
        return _foreground()
    if not args:
        return _front_end()
    print(f"Unrecognized option {' '.join(args)}; usage: {BINARY} [-d | -f]", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
