"""What an unlucky or hostile node does to the daemon: failing backends at the wrong moment, obstacles in the
device-plugin directory, long names. The daemon runs as a separate process against the kubelet stand-in."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.config import check_extended_resource_name
from kxpu.daemon import check_socket_paths, socket_name
from kxpu.daemon.resource import MAX_PLUGIN_DIR
from kxpu.daemon.wire import KUBELET_MAX_MESSAGE_BYTES, REGISTRATION_MAX_MESSAGE_BYTES
from kxpu.sockets import MAX_SOCKET_PATH
from kxpu.testing import KubeletStandIn
from kxpu.testing.kubelet import sockets_in
from kxpu.testing.process import DaemonProcess
from tests.test_daemon import FPGA, NPU, simulated
from tests.waiting import wait_ready, wait_until

ROOT = Path(__file__).parent.parent
BROKEN = "example.com/broken"
IMPORT_TEST_BACKENDS = ("--import", "tests.flaky_backend")
TEST_BACKENDS_ENV = {"PYTHONPATH": str(ROOT)}


def breaking(workdir: Path, name: str = BROKEN) -> dict[str, Any]:
    return {
        "name": name,
        "breaking": {"breakWhen": str(workdir / "break"), "marker": str(workdir / "failures")},
    }


def failures(workdir: Path) -> int:
    try:
        return (workdir / "failures").read_text().count("failing")
    except FileNotFoundError:
        return 0


async def _break_while_serving(kubelet: KubeletStandIn, workdir: Path) -> None:
    """Make the backend fail while the kubelet's ListAndWatch stream is open, and return at once: the
    resource is then being torn down (its server waits for the open stream), the moment that hung stops."""
    await kubelet.wait_registered(BROKEN)
    (workdir / "break").touch()
    await wait_until(lambda: failures(workdir) >= 1, what="the backend to fail", timeout=10)


async def test_sigterm_while_a_failing_resource_is_torn_down_exits_at_once(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    config = write_config([simulated(), breaking(workdir)])
    daemon: DaemonProcess = await daemons(config, *IMPORT_TEST_BACKENDS, env=TEST_BACKENDS_ENV)
    await kubelet.wait_registered(NPU)
    await _break_while_serving(kubelet, workdir)
    daemon.send(signal.SIGTERM)
    assert await daemon.wait(5) == 0, daemon.log_text()
    registered = sum(r == BROKEN for _, r in kubelet.registrations)
    assert registered == 1, f"registered {registered} times; stopping must not register again"
    assert sockets_in(kubelet.plugin_dir) == ["kubelet.sock"]
    log = daemon.log_text()
    assert_one_line_errors(log)
    assert "device library lost its devices" in log
    after = log[log.index("event=stopping") :]
    assert "event=stopped" in after and "registered with the kubelet" not in after


async def test_sighup_removing_a_failing_resource_completes_and_later_reloads_apply(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    config = write_config([simulated(), breaking(workdir)])
    daemon: DaemonProcess = await daemons(config, *IMPORT_TEST_BACKENDS, env=TEST_BACKENDS_ENV)
    await kubelet.wait_registered(NPU)
    await _break_while_serving(kubelet, workdir)
    write_config([simulated()])
    daemon.send(signal.SIGHUP)
    await wait_until(lambda: "config reloaded" in daemon.log_text(), what="the reload to finish", timeout=5)
    await wait_until(
        lambda: socket_name(BROKEN) not in sockets_in(kubelet.plugin_dir),
        what="the removed resource's socket",
    )
    # A later reload is applied too.
    write_config([simulated(), simulated(name="example.com/later", count=1)])
    daemon.send(signal.SIGHUP)
    await kubelet.wait_registered("example.com/later", timeout=5)
    await asyncio.sleep(0)
    assert sum(r == BROKEN for _, r in kubelet.registrations) == 1
    assert (await kubelet.allocate(NPU, ["sim-npu-0"])).container_responses


def assert_one_line_errors(log: str) -> None:
    """Every line is one structured event, and tracebacks appear only at debug level."""
    for line in log.splitlines():
        assert line.startswith("timestamp="), f"not a log event (a raw traceback?): {line[:200]}"
        if "exception=" in line or "Traceback" in line:
            assert "level=debug" in line, f"a traceback above debug level: {line[:300]}"


async def test_a_backend_that_ignores_cancellation_cannot_hang_a_reload_or_a_stop(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    stubborn = {"name": "example.com/stubborn", "stubborn": {}}
    config = write_config([simulated(), stubborn])
    daemon: DaemonProcess = await daemons(config, *IMPORT_TEST_BACKENDS, env=TEST_BACKENDS_ENV)
    await kubelet.wait_registered("example.com/stubborn")
    await kubelet.wait_registered(NPU)
    write_config([simulated()])
    daemon.send(signal.SIGHUP)
    await wait_until(lambda: "config reloaded" in daemon.log_text(), what="the reload to finish", timeout=10)
    assert "resource did not stop in time" in daemon.log_text()
    assert socket_name("example.com/stubborn") not in sockets_in(kubelet.plugin_dir)
    daemon.send(signal.SIGTERM)
    assert await daemon.wait(5) == 1  # it stopped, but could not stop everything
    assert sockets_in(kubelet.plugin_dir) == ["kubelet.sock"]
    assert_one_line_errors(daemon.log_text())


async def _readyz(daemon: DaemonProcess) -> tuple[int, dict[str, Any]]:
    status, body = await daemon.http_get("/readyz")
    return status, json.loads(body)


@pytest.mark.parametrize("obstacle", ["empty directory", "directory", "regular file", "fifo"])
async def test_a_non_socket_at_the_socket_path_is_named_and_served_at_once_when_removed(
    obstacle: str,
    kubelet: KubeletStandIn,
    write_config: Callable[..., Path],
    daemons: Callable[..., Any],
    plugin_dir: Path,
) -> None:
    path = plugin_dir / socket_name(NPU)
    if obstacle.endswith("directory"):
        path.mkdir()
        if obstacle == "directory":
            (path / "something").write_text("kept")
    elif obstacle == "regular file":
        path.write_text("someone's file")
    else:
        os.mkfifo(path)
    daemon: DaemonProcess = await daemons(write_config([simulated(), simulated(name=FPGA, count=1)]))
    await kubelet.wait_registered(FPGA)  # the other resource is not held up
    await wait_until(
        lambda: "is a" in daemon.log_text() and "not a socket" in daemon.log_text(), what="the error"
    )
    status, body = await _readyz(daemon)
    assert status == 503 and body["resources"][NPU] == "failed"
    await asyncio.sleep(2)  # let the obstacle stay a while: a retry backoff would have grown meanwhile
    assert NPU not in kubelet.plugins
    if obstacle.endswith("directory"):
        shutil.rmtree(path)
    else:
        path.unlink()
    removed = asyncio.get_running_loop().time()
    await kubelet.wait_registered(NPU, timeout=5)
    assert asyncio.get_running_loop().time() - removed < 1.0, "the directory watch sees the removal at once"
    await wait_ready(daemon)
    errors = [ln for ln in daemon.log_text().splitlines() if "level=error" in ln]
    assert len(errors) == 1 and "not a socket" in errors[0] and "remove it" in errors[0], errors
    assert_one_line_errors(daemon.log_text())


async def test_long_resource_names_get_short_socket_names_and_are_served(
    write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    # A directory as long as the kubelet's /var/lib/kubelet/device-plugins (31 bytes).
    plugin_dir = workdir / ("p" * (31 - len(str(workdir)) - 1))
    assert len(str(plugin_dir)) == 31
    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    domain = "example.com/"
    names = [
        domain + "n" * (60 - len(domain)),  # socket fits, but the old private bind name passed 107 bytes
        domain + "n" * (65 - len(domain)),  # the socket path is exactly 107 bytes
        domain + "n" * (66 - len(domain)),  # one byte too many: a hashed name
        # The longest valid names ("requests.<domain>" is at most 253): differing only at the end.
        ("d" * 59 + ".") * 4 + "com1/" + "N" * 63,
        ("d" * 59 + ".") * 4 + "com1/" + "N" * 62 + "x",
    ]
    assert len(names[3]) == 308 and check_extended_resource_name(names[3])
    try:
        resources = [{"name": n, "simulated": {"count": 1, "model": f"m{i}"}} for i, n in enumerate(names)]
        await daemons(write_config(resources, devicePluginDir=str(plugin_dir)))
        for i, name in enumerate(names):
            view = await kubelet.wait_registered(name)
            assert len(str(plugin_dir / view.endpoint)) <= 107
            assert view.endpoint == socket_name(name, plugin_dir)
            response = await kubelet.allocate(name, [f"m{i}-0"])
            assert response.container_responses[0].envs["KXPU_VISIBLE_DEVICES"] == f"m{i}-0"
        endpoints = {kubelet.view(n).endpoint for n in names}
        assert len(endpoints) == len(names)
        assert kubelet.view(names[1]).endpoint == "kxpu-" + names[1].replace("/", "_") + ".sock"
        assert "_" not in kubelet.view(names[2]).endpoint
    finally:
        await kubelet.stop()


def test_socket_names_stay_apart_and_within_the_unix_limit() -> None:
    plugin_dir = Path("/var/lib/kubelet/device-plugins")
    readable = socket_name("a.com/b", plugin_dir)
    assert readable == "kxpu-a.com_b.sock" == socket_name("a.com/b")
    for length in range(3, 309):
        name = ("a" * (length - 2) + "/b") if length <= 246 else ("a" * 244 + "/" + "b" * (length - 245))
        path = plugin_dir / socket_name(name, plugin_dir)
        assert len(str(path)) <= 107, name
    long_dir = Path("/" + "d" * (MAX_PLUGIN_DIR - 1))
    assert len(str(long_dir / socket_name("x.com/" + "n" * 63, long_dir))) <= 107
    check_socket_paths(long_dir, ["x.com/" + "n" * 63])
    with pytest.raises(ValueError, match="at most 80"):
        check_socket_paths(Path("/" + "d" * MAX_PLUGIN_DIR), ["x.com/n"])


async def test_readyz_waits_until_the_kubelet_takes_the_device_list(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    kubelet.open_list_and_watch = False  # registers, but never opens ListAndWatch
    daemon: DaemonProcess = await daemons(write_config([simulated()]))
    await kubelet.wait_for(lambda: bool(kubelet.registrations), what="the registration")
    await wait_until(lambda: "registered with the kubelet" in daemon.log_text(), what="the daemon to see it")
    status, body = await _readyz(daemon)
    assert status == 503 and body["resources"] == {NPU: "awaiting-list-and-watch"}
    # The kubelet comes back and takes the list: ready.
    kubelet.open_list_and_watch = True
    await kubelet.restart()
    await kubelet.wait_registered(NPU, times=2)
    assert (await wait_ready(daemon))["resources"] == {NPU: "registered"}


async def test_a_device_the_kubelet_cannot_take_fails_the_resource_loudly(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    config = write_config(
        [
            simulated(),
            {"name": "example.com/numa", "listed": {"numa": 2**63}},  # past int64: protobuf refuses it
            # ~4.6 MB of device list: past what the kubelet's gRPC client accepts in one message.
            {"name": "example.com/many", "listed": {"count": 60000, "idPrefix": "d" * 57 + "-"}},
        ]
    )
    daemon: DaemonProcess = await daemons(config, *IMPORT_TEST_BACKENDS, env=TEST_BACKENDS_ENV)
    await kubelet.wait_registered(NPU)
    await wait_until(
        lambda: (
            "cannot be sent to the kubelet" in daemon.log_text()
            and "the kubelet accepts at most 4194304" in daemon.log_text()
        ),
        what="both errors in the log",
        timeout=20,
    )
    status, body = await _readyz(daemon)
    assert status == 503
    assert body["resources"]["example.com/numa"] == "failed"
    assert body["resources"]["example.com/many"] == "failed"
    assert "example.com/numa" not in kubelet.plugins and "example.com/many" not in kubelet.plugins
    assert_one_line_errors(daemon.log_text())


async def test_sighup_with_an_unusable_file_keeps_the_running_config_in_one_line(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    config = write_config([simulated()])
    daemon: DaemonProcess = await daemons(config)
    await kubelet.wait_registered(NPU)
    unusable = [
        b"\x7fELF\x02\x01\x01\x00\xff\xfe binary junk",  # UnicodeDecodeError
        b"version: v1\nresources: " + b"[" * 1000 + b"]" * 1000 + b"\n",  # RecursionError
        b"version: v1\nresources: [{name: example.com/npu, simulated: {count: 2, env: {A: '{count:d}'}}}]\n",
    ]
    for n, content in enumerate(unusable, start=1):
        config.write_bytes(content)
        daemon.send(signal.SIGHUP)
        await wait_until(functools.partial(_refused_reloads, daemon, n), what=f"reload {n} refused")
    # The last one is applied once it is fixed: later reloads are not stuck behind the bad ones.
    write_config([simulated(count=2)])
    daemon.send(signal.SIGHUP)
    await kubelet.wait_devices(NPU, lambda d: len(d) == 2)
    log = daemon.log_text()
    assert "not UTF-8 text" in log and "nested too deeply" in log and "{count:d}" in log
    assert_one_line_errors(log)


def _refused_reloads(daemon: DaemonProcess, times: int) -> bool:
    return daemon.log_text().count("reload failed; keeping the running config") == times


async def test_an_allocate_answer_past_the_kubelets_limit_is_refused_with_the_reason(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    bulky = {"name": "example.com/bulky", "listed": {"count": 2, "envBytes": KUBELET_MAX_MESSAGE_BYTES + 1}}
    daemon: DaemonProcess = await daemons(write_config([bulky]), *IMPORT_TEST_BACKENDS, env=TEST_BACKENDS_ENV)
    await kubelet.wait_registered("example.com/bulky")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kubelet.allocate("example.com/bulky", ["listed-0"])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"the kubelet accepts at most {KUBELET_MAX_MESSAGE_BYTES}" in (err.value.details() or "")
    await wait_until(lambda: "request refused" in daemon.log_text(), what="the refusal in the log")
    assert_one_line_errors(daemon.log_text())


async def test_a_registration_answer_past_its_limit_is_a_failed_registration(
    write_config: Callable[..., Path], daemons: Callable[..., Any], plugin_dir: Path
) -> None:
    """A "kubelet" that answers Register with 100 KiB (an Empty carrying an unknown field): refused by the
    registration channel's 64 KiB limit, retried, logged in one line."""

    async def register(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return b"\x7a\x80\x80\x06" + b"x" * (100 * 1024)  # field 15, length 102400

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "v1beta1.Registration", {"Register": grpc.unary_unary_rpc_method_handler(register)}
            )
        ]
    )
    server.add_insecure_port(f"unix://{plugin_dir / 'kubelet.sock'}")
    await server.start()
    try:
        daemon: DaemonProcess = await daemons(write_config([simulated()]))
        await wait_until(lambda: "registration failed; retrying" in daemon.log_text(), what="the failure")
        line = next(ln for ln in daemon.log_text().splitlines() if "registration failed" in ln)
        assert "RESOURCE_EXHAUSTED" in line and "registered with the kubelet" not in daemon.log_text()
        assert_one_line_errors(daemon.log_text())
    finally:
        await server.stop(0)


def test_the_largest_register_request_fits_its_limit() -> None:
    longest = ("d" * 59 + ".") * 4 + "com1/" + "N" * 63
    request = pb.RegisterRequest(
        version="v1beta1",
        endpoint="x" * MAX_SOCKET_PATH,
        resource_name=longest,
        options=pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True),
    )
    assert request.ByteSize() < REGISTRATION_MAX_MESSAGE_BYTES // 100


async def test_a_file_where_the_device_plugin_directory_goes_is_named_then_served(
    write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    plugin_dir = workdir / "plugins"
    plugin_dir.write_text("not a directory")
    daemon: DaemonProcess = await daemons(write_config([simulated()], devicePluginDir=str(plugin_dir)))
    await wait_until(
        lambda: "cannot create the device-plugin directory" in daemon.log_text(), what="the error", timeout=10
    )
    assert (await _readyz(daemon))[0] == 503
    plugin_dir.unlink()
    kubelet = KubeletStandIn(plugin_dir)  # makes the directory and serves kubelet.sock in it
    await kubelet.start()
    try:
        await kubelet.wait_registered(NPU, timeout=5)
    finally:
        await kubelet.stop()
    assert_one_line_errors(daemon.log_text())


async def test_sigterm_does_not_wait_for_a_backend_call_that_never_returns(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    config = write_config([simulated(), {"name": "example.com/hung", "hanging": {"seconds": 120}}])
    daemon: DaemonProcess = await daemons(config, *IMPORT_TEST_BACKENDS, env=TEST_BACKENDS_ENV)
    await kubelet.wait_registered(NPU)
    status, body = await _readyz(daemon)
    assert status == 503 and body["resources"]["example.com/hung"] == "starting"
    daemon.send(signal.SIGTERM)
    assert await daemon.wait(10) == 1, "a hung discovery held the process"
    assert sockets_in(kubelet.plugin_dir) == ["kubelet.sock"]
    assert "a backend call did not return" in daemon.log_text()
    assert_one_line_errors(daemon.log_text())
