"""The ``kxpu`` command: the top layer, wiring config, backends and the daemon together."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from kxpu.backends.registry import build_backend, import_backend_module
from kxpu.config import DEFAULT_POD_RESOURCES_SOCKET, Config, ConfigError, ResourceConfig, load_config
from kxpu.logs import LOG_LEVELS, configure_logging, error_text, get_logger
from kxpu.model import Backend, Closable, Device, NodeLabeller

log = get_logger("kxpu.cli")

EXIT_BAD_INPUT = 2


def _fail(message: str) -> None:
    click.echo(f"kxpu: error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _build_plain(resource: ResourceConfig) -> Backend:
    return build_backend(resource.backend, resource.backend_config)


def _build(resource: ResourceConfig) -> Backend:
    """The backend as the daemon serves it: wrapped for CDI output when the resource asks for it."""
    backend = _build_plain(resource)
    if resource.cdi.enabled:
        from kxpu.cdi import with_cdi

        backend = with_cdi(
            backend, resource.name, resource.cdi_kind, resource.cdi.spec_dir, resource.cdi.annotations
        )
    if resource.sharing is not None:  # outermost: slots over the (CDI-wrapped) physical devices
        from kxpu.sharing.kube.node import KubeNodeLink
        from kxpu.sharing.node import SharingBackend

        sharing = resource.sharing
        node = sharing.node_name or os.environ.get("NODE_NAME", "")
        if not node:
            raise ValueError(f"{resource.name}: sharing needs the node name (sharing.nodeName or $NODE_NAME)")
        backend = SharingBackend(backend, resource.name, sharing, lambda: KubeNodeLink(node, sharing), node)
    return backend


def _load(config_path: Path, device_plugin_dir: Path | None, imports: tuple[str, ...]) -> Config:
    """The config, or exit 2 with one line: every fault knowable before serving is refused here."""
    from kxpu.daemon import check_socket_paths

    for module in imports:
        try:
            import_backend_module(module)
        except Exception as exc:  # ImportError, or whatever the module raises as it is imported
            _fail(f"--import {module}: {error_text(exc)}")
    try:
        config = load_config(config_path, device_plugin_dir)
        check_socket_paths(config.device_plugin_dir, [r.name for r in config.resources])
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
        raise  # unreachable; keeps type checkers honest
    return config


config_option = click.option(
    "--config",
    "config_path",
    envvar="KXPU_CONFIG",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Config file (YAML). Env: KXPU_CONFIG.",
)
import_option = click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="Import a module that registers extra backends (repeatable).",
)
log_level_option = click.option(
    "--log-level",
    envvar="KXPU_LOG_LEVEL",
    default="info",
    show_default=True,
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    help="Env: KXPU_LOG_LEVEL.",
)
log_format_option = click.option(
    "--log-format",
    envvar="KXPU_LOG_FORMAT",
    default="text",
    show_default=True,
    type=click.Choice(["text", "json"]),
    help="key=value text or JSON lines. Env: KXPU_LOG_FORMAT.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kxpu")
def main() -> None:
    """kxpu: heterogeneous accelerators on Kubernetes."""


@main.command()
@config_option
@click.option(
    "--device-plugin-dir",
    envvar="KXPU_DEVICE_PLUGIN_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="Overrides devicePluginDir from the file. Env: KXPU_DEVICE_PLUGIN_DIR.",
)
@click.option(
    "--http-address",
    envvar="KXPU_HTTP_ADDRESS",
    default=":9400",
    show_default=True,
    help="[HOST]:PORT for /metrics, /healthz, /readyz; empty to disable. Env: KXPU_HTTP_ADDRESS.",
)
@import_option
@log_level_option
@log_format_option
def plugin(
    config_path: Path,
    device_plugin_dir: Path | None,
    http_address: str,
    imports: tuple[str, ...],
    log_level: str,
    log_format: str,
) -> None:
    """Serve the configured resources to the kubelet (the node daemon)."""
    from kxpu.daemon import Daemon
    from kxpu.daemon.http import parse_address

    configure_logging(log_level, "json" if log_format == "json" else "text")
    config = _load(config_path, device_plugin_dir, imports)
    if http_address:
        try:
            parse_address(http_address)
        except ValueError as exc:
            _fail(str(exc))

    node = os.environ.get("NODE_NAME", "")
    for resource in config.resources:
        if resource.serve == "dra" and not (resource.dra.node_name or node):
            _fail(f"{resource.name}: serving through DRA needs the node name (dra.nodeName or $NODE_NAME)")

    def reload() -> Config:
        return load_config(config_path, device_plugin_dir)

    events = _grant_events() if config.telemetry.enabled and config.telemetry.events else None

    async def serve() -> int:
        daemon = Daemon(
            config,
            reload,
            _build,
            http_address or None,
            dra=lambda *args: _dra(daemon, *args),
            on_grant_exceeded=events,
        )
        code = await daemon.run()
        if daemon.abandoned or daemon.stuck_calls:
            # asyncio's exit would wait for the tasks that ignored cancellation and join the threads of
            # calls that never return: leave now (every socket is removed and the failure logged).
            sys.stderr.flush()
            os._exit(code)
        return code

    sys.exit(asyncio.run(serve()))


def _dra(daemon: Any, resource: ResourceConfig, backend: Backend, snapshot: Any) -> Any:
    """The DRA half of a resource: its API client and the kubelet directories of the running config."""
    from kxpu.dra.claim_cache import ClaimCache
    from kxpu.dra.kube import DraKube
    from kxpu.dra.plugin import DraPlugin

    node = resource.dra.node_name or os.environ.get("NODE_NAME", "")
    if not node:  # checked at start; a reload may bring a DRA resource without one
        raise ValueError(
            f"{resource.name}: serving through DRA needs the node name (dra.nodeName or $NODE_NAME)"
        )
    kube = DraKube(resource.dra_driver)
    config = daemon.config
    return DraPlugin(
        resource.name,
        resource.dra_driver,
        node,
        backend,
        snapshot,
        config.kubelet_plugins_dir,
        config.plugins_registry_dir,
        kube,
        kube,
        resource.dra,
        config.pod_resources_socket,
        close=kube.close,
        claim_cache=ClaimCache(resource.dra_driver, node, kube) if resource.dra.claim_cache else None,
    )


def _grant_events() -> Any:
    """A Warning event on the pod whose container exceeds its grant (telemetry.events), through the API
    server (lightkube is imported only then; the node daemon needs events: create)."""
    from kxpu.daemon.telemetry import GrantExceeded
    from kxpu.kube.client import make_client, post_event

    clients: list[Any] = []

    async def post(event: GrantExceeded) -> None:
        if not clients:  # made on the loop, on first use
            clients.append(make_client())
        usage = event.usage
        await post_event(
            clients[0],
            "Pod",
            usage.namespace,
            usage.pod,
            usage.pod_uid or None,
            "KxpuGrantExceeded",
            event.message,
            "kxpu-node",
        )

    return post


def device_to_json(device: Device) -> dict[str, Any]:
    out: dict[str, Any] = {"id": device.id, "health": device.health.value}
    for key in ("model", "uuid", "index", "memory_mib", "cores", "pci_bus_id"):
        value = getattr(device, key)
        if value is not None:
            out[key] = value
    if device.numa_nodes:
        out["numa_nodes"] = list(device.numa_nodes)
    if device.extra:
        out["extra"] = dict(device.extra)
    return out


@main.command()
@config_option
@import_option
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True)
@log_level_option
def devices(config_path: Path, imports: tuple[str, ...], output: str, log_level: str) -> None:
    """Print what discovery finds for each resource, without serving anything."""
    configure_logging(log_level, "text")
    config = _load(config_path, None, imports)
    found: dict[str, list[Device]] = {}
    labels: dict[str, dict[str, str]] = {}
    errors: dict[str, str] = {}
    for resource in config.resources:
        try:
            backend = _build_plain(resource)  # no CDI wrapper: listing devices writes no spec files
            try:
                found[resource.name] = backend.discover()
                if isinstance(backend, NodeLabeller):
                    labels[resource.name] = backend.node_labels()
            finally:
                if isinstance(backend, Closable):
                    backend.close()
        except Exception as exc:
            errors[resource.name] = error_text(exc)
    if output == "json":
        doc: dict[str, Any] = {
            name: {"backend": r.backend, "devices": [device_to_json(d) for d in found.get(name, [])]}
            for r in config.resources
            for name in [r.name]
        }
        for name, error in errors.items():
            doc[name]["error"] = error
        for name, node_labels in labels.items():
            doc[name]["labels"] = node_labels
        click.echo(json.dumps(doc, indent=2))
    else:
        for resource in config.resources:
            click.echo(f"{resource.name} ({resource.backend})")
            if resource.name in errors:
                click.echo(f"  error: {errors[resource.name]}")
                continue
            for d in found[resource.name]:
                facts = [d.health.value]
                if d.numa_nodes:
                    facts.append("numa=" + ",".join(map(str, d.numa_nodes)))
                facts += [
                    f"{k}={v}"
                    for k, v in device_to_json(d).items()
                    if k not in ("id", "health", "numa_nodes")
                ]
                click.echo(f"  {d.id:<24} " + " ".join(facts))
            for key, value in sorted(labels.get(resource.name, {}).items()):
                click.echo(f"  label {key}={value}")
    sys.exit(1 if errors else 0)


@main.command()
@click.option(
    "--pod-resources-socket",
    type=click.Path(path_type=Path),
    default=str(DEFAULT_POD_RESOURCES_SOCKET),
    show_default=True,
    help="The kubelet's PodResources API socket.",
)
@click.option(
    "--daemon",
    "daemon_url",
    envvar="KXPU_DAEMON_URL",
    default="http://127.0.0.1:9400",
    show_default=True,
    help="The node daemon's --http-address. Env: KXPU_DAEMON_URL.",
)
@click.option("--all-resources", is_flag=True, help="Also list devices of resources kxpu does not serve.")
@click.option(
    "--cluster",
    is_flag=True,
    help="Every node, through the API server: extended resources, the pods holding them, shared devices.",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --cluster: default in-cluster account, else $KUBECONFIG or ~/.kube/config.",
)
@click.option(
    "--resource",
    "resources",
    multiple=True,
    metavar="NAME",
    help="With --cluster: only these resources (repeatable); default every extended resource.",
)
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True)
def status(
    pod_resources_socket: Path,
    daemon_url: str,
    all_resources: bool,
    cluster: bool,
    kubeconfig: Path | None,
    resources: tuple[str, ...],
    output: str,
) -> None:
    """Show which pod holds which device on this node (or, with --cluster, on every node)."""
    if cluster:
        _cluster_status(kubeconfig, frozenset(resources), output)
        return
    from kxpu.status import format_table, node_status

    result = asyncio.run(node_status(pod_resources_socket, daemon_url, all_resources))
    if output == "json":
        click.echo(json.dumps(result.as_json(), indent=2))
    else:
        click.echo(format_table(result))
    # Partial answers are still printed; fail only when neither side could be read.
    sys.exit(1 if len(result.errors) == 2 else 0)


def _check_address(option: str, address: str) -> None:
    from kxpu.sharing.probes import parse_listen

    if address:
        try:
            parse_listen(address)
        except ValueError as exc:
            _fail(f"{option}: {exc}")


def _cluster_status(kubeconfig: Path | None, only: frozenset[str], output: str) -> None:
    from lightkube import AsyncClient, ConfigError, KubeConfig

    from kxpu.kube.client import FIELD_MANAGER
    from kxpu.status import fetch_cluster_status, format_cluster_table

    try:
        config = KubeConfig.from_file(kubeconfig) if kubeconfig else None
        client = AsyncClient(config=config, field_manager=FIELD_MANAGER)
    except (ConfigError, OSError) as exc:
        _fail(f"no access to the API server: {exc}")
    try:
        result = asyncio.run(fetch_cluster_status(client, only))
    except Exception as exc:  # the API server's answer or the connection's failure, said plainly
        click.echo(f"kxpu: error: listing nodes and pods: {exc}", err=True)
        sys.exit(1)
    if output == "json":
        click.echo(json.dumps(result.as_json(), indent=2))
    else:
        click.echo(format_cluster_table(result))


def _control_plane_config(path: Path | None) -> Any:
    from kxpu.sharing.config import SharingConfigError, load_control_plane_config

    try:
        return load_control_plane_config(path)
    except SharingConfigError as exc:
        _fail(str(exc))


control_plane_config_option = click.option(
    "--config",
    "config_path",
    envvar="KXPU_SHARING_CONFIG",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Sharing control-plane config (families, policies, key Secret). Env: KXPU_SHARING_CONFIG.",
)


@main.command()
@control_plane_config_option
@click.option("--address", envvar="KXPU_SCHEDULER_ADDRESS", default=":8888", show_default=True)
@click.option(
    "--metrics-address",
    envvar="KXPU_SCHEDULER_METRICS_ADDRESS",
    default=":9401",
    show_default=True,
    help="[HOST]:PORT for /metrics, /healthz, /readyz (plain HTTP); empty to disable.",
)
@log_level_option
@log_format_option
def scheduler(
    config_path: Path | None, address: str, metrics_address: str, log_level: str, log_format: str
) -> None:
    """Scheduler extender for fractional sharing (filter, prioritize, bind)."""
    import socket

    from kxpu.sharing.extender import serve

    configure_logging(log_level, "json" if log_format == "json" else "text")
    config = _control_plane_config(config_path)
    owner = os.environ.get("POD_NAME") or socket.gethostname()
    _check_address("--metrics-address", metrics_address)
    asyncio.run(serve(config, address, owner, metrics_address))


@main.command()
@control_plane_config_option
@click.option("--address", envvar="KXPU_WEBHOOK_ADDRESS", default=":8443", show_default=True)
@click.option(
    "--metrics-address",
    envvar="KXPU_WEBHOOK_METRICS_ADDRESS",
    default=":9402",
    show_default=True,
    help="[HOST]:PORT for /metrics, /healthz, /readyz (plain HTTP); empty to disable.",
)
@click.option("--tls-cert-file", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tls-key-file", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--trusted-user",
    "trusted_users",
    multiple=True,
    help="Also may change kxpu's pod annotations (besides trustedUsers from the config).",
)
@log_level_option
@log_format_option
def webhook(
    config_path: Path | None,
    address: str,
    metrics_address: str,
    tls_cert_file: Path,
    tls_key_file: Path,
    trusted_users: tuple[str, ...],
    log_level: str,
    log_format: str,
) -> None:
    """Admission webhook for fractional sharing (mutate and validate pods)."""
    from kxpu.sharing.webhook import serve

    configure_logging(log_level, "json" if log_format == "json" else "text")
    config = _control_plane_config(config_path)
    families = config.resource_families()
    trusted = [*config.trusted_users, *trusted_users]
    _check_address("--metrics-address", metrics_address)
    asyncio.run(
        serve(
            families,
            config.scheduler_name,
            trusted,
            address,
            tls_cert_file,
            tls_key_file,
            metrics_address,
            config.protected_env,
        )
    )


if __name__ == "__main__":
    main()
