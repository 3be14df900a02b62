"""Faults knowable at load are refused at load: exit 2 and one line naming the file and the field, never a
traceback, never a config that breaks later at run time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kxpu.backends.generic import GenericBackend, GenericConfig
from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).parent.parent


def config_with(resource: dict[str, object]) -> dict[str, object]:
    return {"version": "v1", "resources": [resource]}


def sim(**section: object) -> dict[str, object]:
    return {"name": "example.com/x", "simulated": {"count": 1, **section}}


@pytest.mark.parametrize(
    ("resource", "where", "message"),
    [
        # The first ID fits, the eleventh does not: refused at load, not at discovery in a loop.
        (sim(model="m" * 61, count=11), "simulated", "makes device IDs up to 'mmm"),
        (sim(count=2, numaNodes=[0, 2**63]), "simulated", "between 0 and 63"),
        (sim(count=2, numaNodes=[0, 64]), "simulated", "between 0 and 63"),
        (sim(count=2, numaNodes=[0, -1]), "simulated", "between 0 and 63"),
        (sim(env={"A": "{ids!x}"}), "simulated.env", "{ids!x} has a conversion or format spec"),
        (sim(env={"A": "{count:d}"}), "simulated.env", "{count:d} has a conversion or format spec"),
        (sim(env={"A": "{ids!r:>5}"}), "simulated.env", "conversion or format spec"),
        (sim(env={"A": "{}"}), "simulated.env", "uses {}"),
        (sim(env={"A": "{ids[0]}"}), "simulated.env", "uses {ids[0]}"),
        (sim(env={"A=B": "x"}), "simulated.env", "env var name 'A=B'"),
        (sim(env={"": "x"}), "simulated.env", "env var name ''"),
        (sim(env={"A\tB": "x"}), "simulated.env", "printable ASCII"),
        (sim(env={"NÄME": "x"}), "simulated.env", "printable ASCII"),
        (sim(env={"A": "x\x00y"}), "simulated.env.A", "NUL"),
        (sim(mounts=[{"hostPath": "/a\x00b", "containerPath": "/b"}]), "simulated.mounts[0].hostPath", "NUL"),
        (
            {
                "name": "example.com/x",
                "generic": {"groups": [{"paths": ["/dev/x"], "env": {"A": "{count:03}"}}]},
            },
            "generic.groups[0].env",
            "conversion or format spec",
        ),
        (
            {
                "name": "example.com/x",
                "generic": {"groups": [{"paths": ["/dev/x"], "containerPath": "/d/{name!s}"}]},
            },
            "generic.groups[0].containerPath",
            "conversion or format spec",
        ),
        (
            {"name": "example.com/x", "generic": {"groups": [{"paths": ["/dev/x\x00"]}]}},
            "generic.groups[0].paths[0]",
            "NUL",
        ),
    ],
)
def test_run_time_faults_are_refused_at_load(resource: dict[str, object], where: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config_with(resource), "c.yaml")
    text = str(err.value)
    assert text.startswith("c.yaml: resources[0]." + where), text
    assert message in text and "\n" not in text


def test_what_load_accepts_works_at_run_time() -> None:
    """The edges that are accepted: 63-character IDs, NUMA node 63, plain placeholders, odd env names."""
    config = SimulatedConfig.model_validate(
        {
            "count": 11,
            "model": "m" * 60,
            "numaNodes": [63] * 11,
            "env": {"A.b-c": "{ids};{count};{indexes};{uuids}", "x y": "{{literal}}"},
        }
    )
    backend = SimulatedBackend(config)
    devices = backend.discover()
    assert max(len(d.id) for d in devices) == 63
    edits = backend.allocate(devices[:2])
    assert edits.env["x y"] == "{literal}" and edits.env["A.b-c"].endswith(
        ";2;0,1;" + f"{devices[0].uuid},{devices[1].uuid}"
    )


def test_many_errors_are_summarised() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config_with(sim(count=4000, numaNodes=["x"] * 4000)), "c.yaml")
    assert "and 3990 more errors" in str(err.value) and len(str(err.value)) < 2000


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe\x00junk\x80", "not UTF-8 text"),
        (b"version: v1\nresources: " + b"[" * 600 + b"]" * 600 + b"\n", "nested too deeply"),
        (b"version: v1\nresources: [\n  - name: a\n    x: {\n", "c.yaml:"),
        (
            b"version: v1\nresources: [{name: a.b/c, simulated: {count: 1}}]\n" + b"#" * (4 * 1024 * 1024),
            "larger",
        ),
    ],
)
def test_unusable_files_are_one_line_config_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text, text
    assert "<unicode string>" not in text


def test_yaml_errors_name_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nresources:\n  - name: example.com/x\n    simulated: {count: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:5:1: not valid YAML: expected ',' or '}}'"), str(err.value)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "kxpu", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.parametrize("command", ["plugin", "devices"])
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe junk", "not UTF-8 text"),
        (b"version: v1\nresources: " + b"[" * 500 + b"]" * 500, "nested too deeply"),
        (b"version: v1\nresources: [{name: a.b/c, simulated: {count: 1}\n", "not valid YAML"),
        (
            b"version: v1\nresources: [{name: example.com/x, simulated: {count: 11, model: "
            + b"m" * 61
            + b"}}]\n",
            "resources[0].simulated",
        ),
        (
            b"version: v1\ndevicePluginDir: /"
            + b"d" * 90
            + b"\nresources: [{name: a.b/c, simulated: {count: 1}}]\n",
            "use a shorter device-plugin directory",
        ),
    ],
)
def test_cli_exits_2_with_one_line(tmp_path: Path, command: str, content: bytes, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    result = run_cli(command, "--config", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("kxpu: error: ") and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["plugin", "devices"])
def test_cli_import_of_a_module_that_raises_exits_2(tmp_path: Path, command: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nresources: [{name: a.b/c, simulated: {count: 1}}]\n")
    result = run_cli(command, "--config", str(path), "--import", "tests.raising_module")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "kxpu: error: --import tests.raising_module: RuntimeError: vendor library refused to initialise: "
        "no licence server\n"
    )


def test_state_file_garbage_keeps_the_last_good_state(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    backend = SimulatedBackend(SimulatedConfig(count=2, model="n", state_file=state))
    state.write_text(json.dumps({"n-1": "Unhealthy"}))
    assert [d.health.value for d in backend.discover()] == ["Healthy", "Unhealthy"]
    for garbage in (
        json.dumps({"n-0": ["Unhealthy"]}),  # not a state: skipped, the rest applies
        "[" * 100000 + "]" * 100000,  # nested past the JSON parser's recursion limit
        b"\xff\xfe",
    ):
        if isinstance(garbage, bytes):
            state.write_bytes(garbage)
        else:
            state.write_text(garbage)
        assert [d.health.value for d in backend.discover()][1] in ("Healthy", "Unhealthy")
    state.unlink()
    state.mkdir()  # a directory where the file goes: logged, last good state kept
    assert len(backend.discover()) == 2


def test_generic_skips_what_is_not_a_device_node(tmp_path: Path) -> None:
    import os
    import stat

    from structlog.testing import capture_logs

    os.mknod(tmp_path / "acc0", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (tmp_path / "acc1").write_text("a regular file")
    os.mkfifo(tmp_path / "acc2")
    (tmp_path / "acc3").symlink_to(tmp_path / "acc0")  # a link to a device node is one
    (tmp_path / "acc4").mkdir()
    backend = GenericBackend(GenericConfig.model_validate({"groups": [{"paths": [str(tmp_path / "acc*")]}]}))
    with capture_logs() as logs:
        assert [d.id for d in backend.discover()] == ["acc0", "acc3"]
        assert [d.id for d in backend.discover()] == ["acc0", "acc3"]
    skipped = {(e["path"], e["found"]) for e in logs if "not a device node" in e["event"]}
    assert (
        len([e for e in logs if "not a device node" in e["event"]]) == 2
    )  # once per path, not per discovery
    assert skipped == {(str(tmp_path / "acc1"), "a regular file"), (str(tmp_path / "acc2"), "a FIFO")}
