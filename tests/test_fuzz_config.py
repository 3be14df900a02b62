"""Fuzzing the config loader: any file gives a Config or one ConfigError line, and what is accepted works at
run time (discovery, the ListAndWatch message, Allocate for any set of devices, its wire message).

The example budget comes from the hypothesis profile (``ci`` in ``make test``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, example, given
from hypothesis import strategies as st

from kxpu.backends.registry import build_backend
from kxpu.cdi import with_cdi
from kxpu.config import Config, ConfigError, load_config, parse_config
from kxpu.daemon import check_socket_paths
from kxpu.daemon.wire import edits_to_pb, list_and_watch_response
from kxpu.model import Backend, Closable

# Values a careless or hostile config author would write where a field expects something else.
TRICKY = [
    "{ids}",
    "{count}",
    "{ids!x}",
    "{count:d}",
    "{ids[0]}",
    "{}",
    "{{ids}}",
    "{name}",
    "{path}",
    "A=B",
    "",
    " ",
    "\x00",
    "/dev/fpga*",
    "dev/x",
    "/",
    "rw",
    "rwx",
    "example.com/npu",
    "sim-npu",
    "x" * 70,
    "\u2028",
    "-1",
    "1e400",
]
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-2, 70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(TRICKY)
)
trees = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
# Valid values, so that most drawn configs are accepted and their run time is exercised; then at most one
# field is replaced by something careless or hostile, so that refusals are exercised too.
PRINTABLE = [chr(c) for c in range(0x20, 0x7F)]
env_names = st.text(alphabet=[c for c in PRINTABLE if c != "="], min_size=1, max_size=8)
templates = st.lists(
    st.sampled_from(["{ids}", "{uuids}", "{indexes}", "{count}", "{{", "}}"])
    | st.text(alphabet=[c for c in PRINTABLE if c not in "{}"], max_size=6),
    max_size=4,
).map("".join)
envs = st.dictionaries(env_names, templates, max_size=3)
absolute = st.sampled_from(["/opt", "/sim", "/usr/local/npu", "/a b/c", "/" + "p" * 200])
mounts = st.lists(
    st.fixed_dictionaries(
        {"hostPath": absolute, "containerPath": absolute}, optional={"readOnly": st.booleans()}
    ),
    max_size=2,
)
names = st.sampled_from(["example.com/npu", "example.com/fpga", "a.b/c", "x.io/" + "n" * 63, "Example.com/x"])


@st.composite
def simulated(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 24) | st.sampled_from([4096]))
    model = draw(st.sampled_from(["sim", "sim-npu", "m" * (62 - len(str(count - 1))), "a.b_c:d"]))
    section: dict[str, Any] = {"count": count, "model": model}
    if draw(st.booleans()):
        section["numaNodes"] = draw(st.lists(st.integers(0, 63), min_size=count, max_size=count))
    for key, values in (("memoryMiB", st.integers(1, 2**40)), ("cores", st.integers(1, 2**20))):
        if draw(st.booleans()):
            section[key] = draw(values)
    if draw(st.booleans()):
        section["env"] = draw(envs)
    if draw(st.booleans()):
        section["mounts"] = draw(mounts)
    return section


def generic(devdir: str) -> st.SearchStrategy[dict[str, Any]]:
    group = st.fixed_dictionaries(
        {
            "paths": st.lists(
                st.sampled_from([f"{devdir}/acc*", f"{devdir}/*", f"{devdir}/acc[0-1]"]), min_size=1
            )
        },
        optional={
            "containerPath": st.sampled_from(["{path}", "/dev/a/{name}", "/x{name}/{path}", "{path}.x"]),
            "permissions": st.sampled_from(["rw", "r", "w", "rwm", "m"]),
            "count": st.integers(1, 5) | st.just(1024),
            "env": envs,
            "mounts": mounts,
        },
    )
    return st.fixed_dictionaries({"groups": st.lists(group, min_size=1, max_size=3)})


def resources(devdir: str) -> st.SearchStrategy[dict[str, Any]]:
    simulated_resource = st.fixed_dictionaries({"name": names, "simulated": simulated()})
    generic_resource = st.fixed_dictionaries({"name": names, "generic": generic(devdir)})
    cdi = st.fixed_dictionaries({"enabled": st.booleans()}, optional={"annotations": st.booleans()})

    def add_cdi(resource: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
        return st.just(resource) | cdi.map(lambda c: {**resource, "cdi": c})

    return (simulated_resource | generic_resource).flatmap(add_cdi)


def _paths(doc: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a document where a value could be replaced."""
    out = [at] if at else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*at, key))
    elif isinstance(doc, list):
        for n, value in enumerate(doc):
            out += _paths(value, (*at, n))
    return out


@st.composite
def configs(draw: st.DrawFn, devdir: str) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": "v1",
        "resources": draw(st.lists(resources(devdir), min_size=1, max_size=3, unique_by=lambda r: r["name"])),
    }
    if draw(st.booleans()):
        doc["devicePluginDir"] = draw(st.sampled_from(["/var/lib/kubelet/device-plugins", "/" + "d" * 90]))
    if draw(st.booleans()):  # one careless or hostile value somewhere
        where = draw(st.sampled_from(_paths(doc)))
        parent: Any = doc
        for key in where[:-1]:
            parent = parent[key]
        parent[where[-1]] = draw(leaves | trees)
    return doc


@pytest.fixture(scope="module")
def devdir() -> Iterator[str]:
    """Two character devices, a regular file and a directory the generic globs can match."""
    path = tempfile.mkdtemp(prefix="kxc-", dir="/tmp")
    for n in (0, 1):
        os.mknod(f"{path}/acc{n}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    Path(f"{path}/acc-file").write_text("not a device")
    os.mkdir(f"{path}/acc-dir")
    yield path
    shutil.rmtree(path)


def _works_at_run_time(config: Config, spec_dir: Path) -> None:
    """What the daemon does with an accepted config: the socket check, then for each resource: build,
    discover, encode the device list, allocate single devices and all together, encode the answers."""
    with contextlib.suppress(ValueError):  # refused at load by the CLI, with exit 2
        check_socket_paths(config.device_plugin_dir, [r.name for r in config.resources])
    for resource in config.resources:
        if resource.backend not in ("simulated", "generic"):
            continue
        backend: Backend = build_backend(resource.backend, resource.backend_config)
        if resource.cdi.enabled:
            backend = with_cdi(backend, resource.name, resource.cdi_kind, spec_dir, resource.cdi.annotations)
        try:
            devices = backend.discover()
            list_and_watch_response(devices)
            for device in devices[:16]:
                edits_to_pb(backend.allocate([device]))
            if devices:
                edits_to_pb(backend.allocate(devices))
        finally:
            if isinstance(backend, Closable):
                backend.close()


@given(data=st.data())
@example(data=None)  # the documented example
def test_a_config_is_refused_in_one_line_or_works(devdir: str, data: st.DataObject | None) -> None:
    doc = (
        {"version": "v1", "resources": [{"name": "example.com/npu", "simulated": {"count": 4}}]}
        if data is None
        else data.draw(configs(devdir))
    )
    try:
        config = parse_config(doc, "c.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("c.yaml: ") and "\n" not in str(exc), str(exc)
        event("refused")
        return
    event(f"accepted, {len(config.resources)} resources")
    with tempfile.TemporaryDirectory(prefix="kxc-cdi-") as spec_dir:
        _works_at_run_time(config, Path(spec_dir))


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@example(b"version: v1\nresources: &a [*a]\n")  # a recursive alias
@example(b"\xef\xbb\xbfversion: v1\n")  # a UTF-8 byte-order mark
@example(b"version: !!python/object:os.system ls\n")  # tags safe_load refuses
def test_any_file_is_a_config_or_one_config_error(content: bytes) -> None:
    with tempfile.NamedTemporaryFile(suffix=".yaml") as f:
        f.write(content)
        f.flush()
        try:
            load_config(Path(f.name))
        except ConfigError as exc:
            assert str(exc).startswith(f.name) and "\n" not in str(exc), str(exc)


@given(trees)
def test_any_yaml_document_is_a_config_or_one_config_error(doc: Any) -> None:
    try:
        text = yaml.safe_dump(doc)
    except (yaml.YAMLError, ValueError):
        return
    with tempfile.NamedTemporaryFile(suffix=".yaml", mode="w") as f:
        f.write(text)
        f.flush()
        try:
            load_config(Path(f.name))
        except ConfigError as exc:
            assert "\n" not in str(exc), str(exc)
