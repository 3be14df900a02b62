from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kxpu.backends.generic import GenericConfig
from kxpu.backends.simulated import SimulatedConfig
from kxpu.config import (
    DEFAULT_DEVICE_PLUGIN_DIR,
    ConfigError,
    check_extended_resource_name,
    load_config,
    parse_config,
)

ISSUE_EXAMPLE = """
version: v1
devicePluginDir: /var/lib/kubelet/device-plugins
resources:
  - name: example.com/npu
    simulated:
      count: 4
      model: sim-npu
      memoryMiB: 16384
      numaNodes: [0, 0, 1, 1]
      stateFile: /run/kxpu/sim-npu.json
  - name: example.com/fpga
    generic:
      groups:
        - paths: ["/dev/fpga*"]
          containerPath: "/dev/fpga_accel/{name}"
          permissions: rw
          env: {FPGA_VISIBLE_DEVICES: "{ids}"}
"""


def test_the_documented_example_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(ISSUE_EXAMPLE)
    config = load_config(path)
    npu, fpga = config.resources
    assert npu.backend == "simulated" and isinstance(npu.backend_config, SimulatedConfig)
    assert npu.backend_config.memory_mib == 16384 and npu.backend_config.numa_nodes == [0, 0, 1, 1]
    assert fpga.backend == "generic" and isinstance(fpga.backend_config, GenericConfig)
    assert fpga.backend_config.groups[0].container_path == "/dev/fpga_accel/{name}"
    assert load_config(path, Path("/x")).device_plugin_dir == Path("/x")


@pytest.mark.parametrize(
    "name", ["example.com/npu", "nvidia.com/gpu", "a.b/c_d.e-f", "example.com/MiG-1g.5gb"]
)
def test_valid_extended_resource_names(name: str) -> None:
    assert check_extended_resource_name(name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("npu", "needs a domain"),
        ("kubernetes.io/npu", "reserved"),
        ("foo.kubernetes.io/npu", "reserved"),
        ("requests.example.com/npu", "requests."),
        ("Example.com/npu", "DNS subdomain"),
        ("example.com/-npu", "name part"),
        ("example.com/" + "n" * 64, "name part"),
        ("example.com/a/b", "more than one"),
    ],
)
def test_invalid_extended_resource_names(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_extended_resource_name(name)


def config_with(resource: dict[str, object]) -> dict[str, object]:
    return {"version": "v1", "resources": [resource]}


@pytest.mark.parametrize(
    ("resource", "message"),
    [
        ({"name": "example.com/x"}, "exactly one backend key (found: none)"),
        (
            {"name": "example.com/x", "simulated": {"count": 1}, "generic": {"groups": []}},
            "exactly one backend key",
        ),
        ({"name": "example.com/x", "simulatd": {"count": 1}}, "unknown key(s) 'simulatd'"),
        (
            {"name": "example.com/x", "simulated": {"count": 0}},
            "simulated.count: Input should be greater than or equal to 1",
        ),
        (
            {"name": "example.com/x", "simulated": {"count": 2, "numaNodes": [0]}},
            "numaNodes has 1 entries for 2 devices",
        ),
        ({"name": "example.com/x", "simulated": {"count": 1, "env": {"A": "{nope}"}}}, "uses {nope}"),
        (
            {"name": "example.com/x", "simulated": {"count": 1, "colour": "red"}},
            "simulated.colour: Extra inputs",
        ),
        ({"name": "example.com/x", "generic": {"groups": [{"paths": ["dev/x"]}]}}, "must be absolute"),
        (
            {"name": "example.com/x", "generic": {"groups": [{"paths": ["/dev/x"], "permissions": "rx"}]}},
            "permissions",
        ),
        ({"name": "x", "simulated": {"count": 1}}, "resources[0].name"),
    ],
)
def test_bad_configs_name_the_field(resource: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config_with(resource), "c.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("c.yaml: ")


def test_top_level_errors() -> None:
    with pytest.raises(ConfigError, match="version"):
        parse_config({"version": "v2", "resources": [{"name": "a.b/c", "simulated": {"count": 1}}]})
    with pytest.raises(ConfigError, match=r"repeated: a\.b/c"):
        r = {"name": "a.b/c", "simulated": {"count": 1}}
        parse_config({"version": "v1", "resources": [r, r]})
    with pytest.raises(ConfigError, match="resources"):
        parse_config({"version": "v1", "resources": []})
    assert (
        parse_config(config_with({"name": "a.b/c", "simulated": {"count": 1}})).device_plugin_dir
        == DEFAULT_DEVICE_PLUGIN_DIR
    )


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nresources: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kxpu", *args], capture_output=True, text=True, timeout=30, env=env
    )


def test_cli_exits_2_with_the_field_named(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nresources:\n  - name: example.com/npu\n    simulated: {count: -1}\n")
    for command in ("plugin", "devices"):
        result = run_cli(command, "--config", str(path))
        assert result.returncode == 2, result.stderr
        assert "resources[0].simulated.count" in result.stderr
    result = run_cli("plugin", "--config", str(path), "--log-level", "loud")
    assert result.returncode == 2 and "--log-level" in result.stderr
    result = run_cli("plugin", "--config", str(path), "--import", "no.such.module")
    assert result.returncode == 2 and "no.such.module" in result.stderr


def test_cli_refuses_socket_paths_longer_than_unix_allows(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    long_dir = "/tmp/" + "d" * 90
    path.write_text(
        f"version: v1\ndevicePluginDir: {long_dir}\nresources: [{{name: example.com/npu, simulated: {{count: 1}}}}]\n"
    )
    result = run_cli("plugin", "--config", str(path))
    assert result.returncode == 2
    assert "unix socket paths are limited to 107 bytes" in result.stderr


def test_cdi_kinds_must_be_unique() -> None:
    both = [
        {
            "name": f"example.com/{n}",
            "simulated": {"count": 1},
            "cdi": {"enabled": True, "kind": "example.com/x"},
        }
        for n in ("a", "b")
    ]
    with pytest.raises(ConfigError, match=r"CDI kinds must be unique.*example\.com/x"):
        parse_config({"version": "v1", "resources": both})


# Settings a file sets that would be accepted and ignored: each is refused at load, on one line naming it.
SET_WHILE_OFF = [
    (
        "resources: [{name: example.com/npu, simulated: {count: 1}}]\ntelemetry: {events: true}\n",
        "c.yaml: telemetry: events set, but telemetry is off: set enabled: true to use it "
        "(or enabled: false to keep telemetry off)",
    ),
    (
        "resources: [{name: nvidia.com/gpu, nvidia: {mps: {setComputeMode: false}}}]\n",
        "c.yaml: resources[0].nvidia: mps: setComputeMode set, but MPS is off: set mps.enabled: true or give "
        "sharing.mps replicas (or mps.enabled: false to keep MPS off)",
    ),
    (
        "resources: [{name: nvidia.com/gpu, nvidia: {health: {recovery: {quietPeriodSeconds: 60}}}}]\n",
        "c.yaml: resources[0].nvidia.health.recovery: quietPeriodSeconds set, but health recovery is off: "
        "set enabled: true to use it (or enabled: false to keep health recovery off)",
    ),
    (
        "resources: [{name: nvidia.com/gpu, nvidia: {sharedDevicesAllocationPolicy: packed}}]\n",
        "c.yaml: resources[0].nvidia: sharedDevicesAllocationPolicy packed places replicas, and no "
        "sharing.timeSlicing or sharing.mps resources make any: add replicas, or drop the key",
    ),
    (
        "resources: [{name: habana.ai/gaudi, gaudi: {health: {recovery: {quietPeriodSeconds: 60}}}}]\n",
        "c.yaml: resources[0].gaudi.health.recovery: quietPeriodSeconds set, but health recovery is off: "
        "set enabled: true to use it (or enabled: false to keep health recovery off)",
    ),
]


@pytest.mark.parametrize(
    ("body", "line"), SET_WHILE_OFF, ids=["telemetry", "mps", "nvidia-recovery", "packed", "gaudi"]
)
def test_settings_that_would_be_ignored_are_refused_on_one_line(tmp_path: Path, body: str, line: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\n" + body)
    result = run_cli("devices", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.replace(str(tmp_path) + "/", "") == f"kxpu: error: {line}\n"


def test_a_switch_given_off_keeps_its_settings_without_complaint() -> None:
    """enabled: false written out is a choice (a feature turned off for now, its settings kept)."""
    parse_config(
        {
            "version": "v1",
            "resources": [
                {
                    "name": "nvidia.com/gpu",
                    "nvidia": {
                        "mps": {"enabled": False, "setComputeMode": False},
                        "health": {"recovery": {"enabled": False, "quietPeriodSeconds": 60}},
                    },
                },
                {
                    "name": "example.com/npu",
                    "simulated": {"count": 1},
                    "serve": "dra",
                    "dra": {"nodeName": "n"},
                },
            ],
            "telemetry": {"enabled": False, "events": True},
        }
    )


def test_a_dra_section_without_serve_dra_is_one_warning(tmp_path: Path) -> None:
    """Not refused: after a resource moves from DRA to the device plugin, its dra: section still serves to
    unprepare the claims left (kxpu.dra.leftover). But it almost always means a forgotten serve: dra."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "version: v1\nresources:\n  - {name: example.com/npu, simulated: {count: 1}, dra: {nodeName: n1}}\n"
    )
    result = run_cli("devices", "--config", str(path))
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    assert (
        "level=warning" in line
        and (
            f'event="{path}: resources[0]: dra: applies to a resource served through DRA, and this one has serve: '
            "devicePlugin; set serve: dra (the section is used only to unprepare claims left from when it was served "
            'through DRA)"'
        )
        in line
    )


def test_a_retired_telemetry_setting_says_to_remove_it() -> None:
    """``telemetry.kubeletDraCheckpoint`` went when pod UIDs came from reservedFor: a file keeping it is told what
    to do rather than shown pydantic's "extra inputs are not permitted"."""
    body = config_with({"name": "a.b/c", "simulated": {"count": 1}})
    body["telemetry"] = {"enabled": True, "kubeletDraCheckpoint": "/var/lib/kubelet/dra_manager_state"}
    with pytest.raises(ConfigError, match=r"kubeletDraCheckpoint is no longer read .*: remove it"):
        parse_config(body)
