"""The host-root reader every vendor backend uses, and the fake tree its tests run over."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from asyncinotify import Inotify, Mask

from kxpu.backends.host import Host, HostBackendConfig, HostFileError, host_changes
from kxpu.model import Device, Health
from kxpu.testing.fake_host import FakeHost, FakeHostError


@pytest.fixture
def fake() -> Iterator[FakeHost]:
    host = FakeHost()
    yield host
    host.cleanup()


def test_reads_go_through_the_root_and_name_host_paths(fake: FakeHost) -> None:
    fake.write_attribute("/sys/class/x/dev0/vendor", "0x1002")
    fake.write_attribute("/sys/class/x/dev0/numa_node", -1)
    fake.write_attribute("/sys/class/x/dev1/vendor", "0x8086")
    host = Host(fake.root)
    assert host.read_int("/sys/class/x/dev0/vendor", 16) == 0x1002
    assert host.read_int("/sys/class/x/dev0/numa_node") == -1
    assert host.read("/sys/class/x/dev9/vendor") is None
    assert host.glob("/sys/class/x/dev*") == ["/sys/class/x/dev0", "/sys/class/x/dev1"]
    assert host.listdir("/sys/class/x") == ["dev0", "dev1"]
    assert host.listdir("/sys/class/missing") == []


def test_garbage_names_the_file(fake: FakeHost) -> None:
    fake.write_attribute("/sys/a/numa_node", "banana")
    fake.write_file("/sys/a/binary", b"\xff\xfe\x00")
    fake.write_attribute("/sys/a/properties", "cpu_cores_count 0\nbroken\n")
    fake.mkdir("/sys/a/dir")
    host = Host(fake.root)
    with pytest.raises(HostFileError, match=r"/sys/a/numa_node: expected an integer, found 'banana'"):
        host.read_int("/sys/a/numa_node")
    with pytest.raises(HostFileError, match=r"/sys/a/binary: not text"):
        host.read("/sys/a/binary")
    with pytest.raises(HostFileError, match=r"/sys/a/properties: line 2 is not 'key value'"):
        host.read_properties("/sys/a/properties")
    with pytest.raises(HostFileError, match="found a directory"):
        host.read("/sys/a/dir")


def test_properties(fake: FakeHost) -> None:
    fake.write_attribute("/p", "cpu_cores_count 0\nsimd_count 304\n\ngfx_target_version 90402")
    assert Host(fake.root).read_properties("/p") == {
        "cpu_cores_count": "0",
        "simd_count": "304",
        "gfx_target_version": "90402",
    }


def test_device_nodes(fake: FakeHost) -> None:
    fake.device_node("/dev/kfd", 234, 0)
    fake.write_file("/dev/not-a-node", "x")
    host = Host(fake.root)
    assert host.exists("/dev/kfd")
    assert host.is_device_node("/dev/kfd") == (os.geteuid() == 0)
    assert not host.is_device_node("/dev/not-a-node")


def test_refuses_the_real_host() -> None:
    with pytest.raises(FakeHostError, match="real host"):
        FakeHost(Path("/"))


def test_config_root_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="must be an absolute path"):
        HostBackendConfig(host_root=Path("relative"))


async def test_set_attribute_raises_no_inotify_event_like_sysfs(fake: FakeHost) -> None:
    """The fidelity the fakes promise: a value change is invisible to inotify, a new node is not."""
    fake.write_attribute("/sys/dev0/health", "ok")
    with Inotify() as inotify:
        inotify.add_watch(fake.path("/sys/dev0"), Mask.MODIFY | Mask.CLOSE_WRITE | Mask.ATTRIB | Mask.CREATE)
        fake.set_attribute("/sys/dev0/health", "bad")
        assert Host(fake.root).read("/sys/dev0/health") == "bad"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(aiter(inotify)), 0.2)
        fake.write_attribute("/sys/dev0/new", "1")
        event = await asyncio.wait_for(anext(aiter(inotify)), 2)
        assert event.path is not None and event.path.name == "new"


async def test_host_changes_polls_values_and_watches_directories(fake: FakeHost) -> None:
    fake.write_attribute("/sys/devs/a/health", "ok")
    host = Host(fake.root)

    def discover() -> list[Device]:
        return [
            Device(
                id=name,
                health=Health.HEALTHY if host.read(f"/sys/devs/{name}/health") == "ok" else Health.UNHEALTHY,
            )
            for name in host.listdir("/sys/devs")
        ]

    changes = host_changes(discover, lambda: ["/sys/devs"], host, poll_seconds=0.2)
    try:
        assert [d.id for d in await anext(changes)] == ["a"]
        # A new device directory: inotify, well under the poll interval's multiples.
        fake.write_attribute("/sys/devs/b/health", "ok")
        assert [d.id for d in await asyncio.wait_for(anext(changes), 2)] == ["a", "b"]
        # A value change: no inotify event, found by polling.
        fake.set_attribute("/sys/devs/a/health", "bad")
        devices = await asyncio.wait_for(anext(changes), 2)
        assert [d.health for d in devices] == [Health.UNHEALTHY, Health.HEALTHY]
    finally:
        await changes.aclose()


async def test_host_changes_keeps_the_last_list_when_discovery_fails(fake: FakeHost) -> None:
    fake.write_attribute("/sys/v", "1")
    host = Host(fake.root)

    def discover() -> list[Device]:
        return [Device(id=f"d{host.read_int('/sys/v')}")]

    changes = host_changes(discover, lambda: [], host, poll_seconds=0.1)
    try:
        assert [d.id for d in await anext(changes)] == ["d1"]
        fake.set_attribute("/sys/v", "garbage")
        fake.set_attribute("/sys/v", "2")  # the failing read in between (if polled) is only logged
        assert [d.id for d in await asyncio.wait_for(anext(changes), 2)] == ["d2"]
    finally:
        await changes.aclose()
