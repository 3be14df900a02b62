"""devicePluginHandover alongside: a second daemon serves a socket of its own and registers beside the first, so a
kubelet that keeps both (Kubernetes 1.37's device manager) never counts the devices unhealthy during a rolling
update. The daemons are separate processes; the kubelet stand-in mirrors 1.37's endpoints per socket."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kxpu.daemon import check_socket_paths, socket_name
from kxpu.daemon.resource import MAX_PLUGIN_DIR_ALONGSIDE
from kxpu.testing import KubeletStandIn
from kxpu.testing.kubelet import sockets_in
from tests.waiting import wait_ready, wait_until

NPU = "example.com/npu"
PREFIX = socket_name(NPU).removesuffix(".sock") + "@"


def simulated(count: int = 4) -> dict[str, Any]:
    return {"name": NPU, "simulated": {"count": count, "model": "sim-npu"}}


def instances(plugin_dir: Path) -> list[str]:
    return sorted(n for n in sockets_in(plugin_dir) if n.startswith(PREFIX))


async def test_a_second_daemon_registers_alongside_and_the_devices_never_drop(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], plugin_dir: Path
) -> None:
    kubelet.endpoints_per_socket = True
    config = write_config([simulated()], devicePluginHandover="alongside")
    first = await daemons(config)
    first_view = await kubelet.wait_registered(NPU)
    assert first_view.endpoint.startswith(PREFIX) and first_view.endpoint.endswith(".sock")
    second = await daemons(config)
    second_view = await kubelet.wait_registered(NPU, times=2)
    await wait_ready(second)  # Ready as soon as it is registered: the DaemonSet may now remove the old pod
    assert second_view.endpoint != first_view.endpoint
    assert instances(plugin_dir) == sorted([first_view.endpoint, second_view.endpoint])
    assert "standing by" not in second.log_text()

    assert await first.stop() == 0  # the rolling update removes the old pod
    await wait_until(lambda: instances(plugin_dir) == [second_view.endpoint], what="the old socket removed")
    await kubelet.wait_for(lambda: kubelet.view(NPU) is second_view, what="the new plugin the one called")
    response = await kubelet.allocate(NPU, ["sim-npu-2"])
    assert response.container_responses[0].envs["KXPU_VISIBLE_DEVICES"] == "sim-npu-2"
    # Every device list the node took, from either daemon, had all four devices healthy: nothing dropped.
    seen = [sum(h == "Healthy" for h in e.devices.values()) for e in kubelet.resource_history[NPU]]
    assert seen and min(seen) == 4, seen

    # A kubelet restart removes the sockets; the daemon serves a new one and registers again.
    await kubelet.restart()
    await kubelet.wait_registered(NPU, times=3, timeout=5)
    again = kubelet.view(NPU).endpoint
    assert again != second_view.endpoint and instances(plugin_dir) == [again]
    assert kubelet.view(NPU).allocatable == 4


async def test_alongside_on_a_kubelet_before_1_37_registers_again_when_it_is_dropped(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], plugin_dir: Path
) -> None:
    """Before 1.37 the kubelet keeps one plugin per resource, and when the replaced one's stream ends it disconnects
    the newest: the new daemon notices and registers again on a new socket, so the devices come back at once (the
    gap standby has too) instead of staying unhealthy until a restart."""
    assert not kubelet.endpoints_per_socket
    config = write_config([simulated()], devicePluginHandover="alongside")
    first = await daemons(config)
    await kubelet.wait_registered(NPU)
    second = await daemons(config)
    dropped = await kubelet.wait_registered(NPU, times=2)
    await wait_ready(second)
    assert await first.stop() == 0
    await kubelet.wait_for(lambda: dropped.disconnected, what="the kubelet to drop the newest plugin")
    again = await kubelet.wait_registered(NPU, times=3, timeout=5)
    assert again.endpoint not in (dropped.endpoint,) and again.endpoint.startswith(PREFIX)
    await kubelet.wait_devices(NPU, lambda d: list(d.values()) == ["Healthy"] * 4, timeout=5)
    assert "the kubelet let go of this plugin; registering again on a new socket" in second.log_text()
    await wait_until(lambda: instances(plugin_dir) == [again.endpoint], what="only the live socket left")
    await wait_ready(second)


async def test_a_failed_registration_is_retried_on_a_new_socket(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], plugin_dir: Path
) -> None:
    """A Register that failed may still have registered the socket (its answer lost); a 1.37 kubelet asked twice for
    one socket refuses and forgets the first, so the retry serves and registers a new one."""
    kubelet.endpoints_per_socket = True
    kubelet.reject_next = 1
    daemon = await daemons(write_config([simulated()], devicePluginHandover="alongside"))
    view = await kubelet.wait_registered(NPU)
    served = re.findall(r"event=serving .*socket=\S*/(\S+)", daemon.log_text())
    assert len(served) == 2 and served[1] == view.endpoint != served[0], served
    assert instances(plugin_dir) == [view.endpoint]  # the first one's socket removed
    assert kubelet.rejections == ["registration refused by the test"]


async def test_sockets_a_killed_daemon_left_are_removed_and_a_live_one_is_not(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], plugin_dir: Path
) -> None:
    kubelet.endpoints_per_socket = True
    dead = [plugin_dir / f"{PREFIX}0badc0de.sock", plugin_dir / socket_name(NPU)]  # alongside's, standby's
    for path in dead:
        with socket.socket(socket.AF_UNIX) as left:  # bound, never listening: what a killed process leaves
            left.bind(str(path))
    live = plugin_dir / f"{PREFIX}a11ve000.sock"
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(live))
        other.listen()
        daemon = await daemons(write_config([simulated()], devicePluginHandover="alongside"))
        view = await kubelet.wait_registered(NPU)
        assert not any(path.exists() for path in dead), sockets_in(plugin_dir)
        assert live.exists() and instances(plugin_dir) == sorted([live.name, view.endpoint])
        assert "removed sockets nobody serves" in daemon.log_text()


def test_alongside_socket_names_fit_the_unix_limit_and_say_whose_resource() -> None:
    long_dir = Path("/" + "d" * (MAX_PLUGIN_DIR_ALONGSIDE - 1))
    for name in ("x.com/" + "n" * 63, "a.com/b"):
        path = long_dir / socket_name(name, long_dir, "0123abcd")
        assert (
            len(str(path)) <= 107 and path.name.startswith("kxpu-") and path.name.endswith("@0123abcd.sock")
        )
    check_socket_paths(long_dir, ["x.com/n"], "alongside")
    with pytest.raises(
        ValueError, match=f"at most {MAX_PLUGIN_DIR_ALONGSIDE}.*devicePluginHandover: standby"
    ):
        check_socket_paths(Path("/" + "d" * MAX_PLUGIN_DIR_ALONGSIDE), ["x.com/n"], "alongside")
    check_socket_paths(Path("/" + "d" * MAX_PLUGIN_DIR_ALONGSIDE), ["x.com/n"], "standby")  # as before
