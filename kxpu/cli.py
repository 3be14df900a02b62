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
from kxpu.model import Backend, Closable, NodeLabeller

log = get_logger("kxpu.cli")

EXIT_BAD_INPUT = 2
# The node daemon's HTTP port: outside the Prometheus exporter range (9100-9999, every number allocated there,
# 9400 being dcgm-exporter's), Kubernetes' (10248-10260) and the usual 8080/8081/9090-9093; "kxpu" on a phone
# keypad.
DEFAULT_HTTP_PORT = 5978


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
        from kxpu.kube.sharing.node import KubeNodeLink
        from kxpu.sharing.node import SharingBackend

        sharing = resource.sharing
        node = sharing.node_name or os.environ.get("NODE_NAME", "")
        if not node:
            raise ValueError(f"{resource.name}: sharing needs the node name (sharing.nodeName or $NODE_NAME)")
        backend = SharingBackend(backend, resource.name, sharing, lambda: KubeNodeLink(node, sharing), node)
    return backend


def _load(config_path: Path, device_plugin_dir: Path | None, imports: tuple[str, ...]) -> Config:
    """The config, or exit 2 with one line: every fault knowable before serving is refused here."""
    from kxpu.backends.fakes import check_fake_envs
    from kxpu.daemon import check_socket_paths

    for module in imports:  # extra backends, or a fake machine's library (kxpu.backends.fakes)
        try:
            import_backend_module(module)
        except Exception as exc:  # ImportError, or whatever the module raises as it is imported
            _fail(f"--import {module}: {error_text(exc)}")
    try:
        check_fake_envs(os.environ)
    except ValueError as exc:
        _fail(str(exc))
    try:
        config = load_config(config_path, device_plugin_dir)
        check_socket_paths(
            config.device_plugin_dir, [r.name for r in config.resources], config.device_plugin_handover
        )
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
        raise  # unreachable; keeps type checkers honest
    for i, resource in enumerate(config.resources):
        if resource.dra_unserved:
            log.warning(
                f"{config_path}: resources[{i}]: dra: applies to a resource served through DRA, and this one has "
                "serve: devicePlugin; set serve: dra (the section is used only to unprepare claims left from when "
                "it was served through DRA)"
            )
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
    help="Import a module that registers extra backends, or plugs in a fake machine (repeatable).",
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
    default=f":{DEFAULT_HTTP_PORT}",
    show_default=True,
    help="[HOST]:PORT for /metrics, /healthz, /readyz, /status; empty to disable. Env: KXPU_HTTP_ADDRESS.",
)
@click.option(
    "--http-auth",
    envvar="KXPU_HTTP_AUTH",
    type=click.Choice(["kubernetes", "none"]),
    default="kubernetes",
    show_default=True,
    help="Who may GET /status: kubernetes = a bearer token the API server authenticates (TokenReview) whose "
    "user may get that non-resource URL (SubjectAccessReview); none = whoever reaches the port. The probes are "
    "never checked. Env: KXPU_HTTP_AUTH.",
)
@click.option(
    "--http-auth-metrics/--no-http-auth-metrics",
    envvar="KXPU_HTTP_AUTH_METRICS",
    default=False,
    show_default=True,
    help="Check /metrics as /status (Prometheus then needs a token allowed to get /metrics). "
    "Env: KXPU_HTTP_AUTH_METRICS.",
)
@import_option
@log_level_option
@log_format_option
def plugin(
    config_path: Path,
    device_plugin_dir: Path | None,
    http_address: str,
    http_auth: str,
    http_auth_metrics: bool,
    imports: tuple[str, ...],
    log_level: str,
    log_format: str,
) -> None:
    """Serve the configured resources to the kubelet (the node daemon)."""
    from kxpu.daemon import Daemon, late_metrics
    from kxpu.daemon.http_listen import HttpAddressError, parse_address

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
    if _pod_uid() is not None:
        from kxpu.dra.config import check_dra_socket_paths, check_instance

        try:
            instance = check_instance(_pod_uid() or "")
            for resource in config.resources:
                if resource.serve == "dra":
                    check_dra_socket_paths(
                        config.kubelet_plugins_dir, config.plugins_registry_dir, resource.dra_driver, instance
                    )
        except ValueError as exc:
            _fail(str(exc))

    def reload() -> Config:
        return load_config(config_path, device_plugin_dir)

    events = _grant_events() if config.telemetry.enabled and config.telemetry.events else None
    authorize = _http_authorizer() if http_address and http_auth == "kubernetes" else None

    async def serve() -> int:
        # Before the draining drivers' plugins take their series: metrics load once the resources have registered.
        late_metrics.defer()
        leftovers = _leftovers(config, node)
        daemon = Daemon(
            config,
            reload,
            _build,
            http_address or None,
            dra=lambda resource, backend, snapshot: _dra(daemon, resource, backend, snapshot, leftovers),
            on_grant_exceeded=events,
            leftovers=leftovers,
            http_authorize=authorize,
            http_protect_metrics=http_auth_metrics,
        )
        code = await daemon.run()
        if daemon.abandoned or daemon.stuck_calls:
            # asyncio's exit would wait for the tasks that ignored cancellation and join the threads of
            # calls that never return: leave now (every socket is removed and the failure logged).
            sys.stderr.flush()
            os._exit(code)
        return code

    try:
        code = asyncio.run(serve())
    except HttpAddressError as exc:
        _fail(str(exc))
        raise  # unreachable
    sys.exit(code)


def _http_authorizer() -> Any:
    """TokenReview + SubjectAccessReview through the API server (lightkube is loaded at the first review).
    Without API access the daemon still serves, and /status answers 503 saying why."""
    from kxpu.kube.review import ReviewAuthorizer, api_access_problem

    problem = api_access_problem()
    if problem:
        return ReviewAuthorizer(
            None,
            f"--http-auth=kubernetes, but this daemon has no API access to review tokens ({problem}): give it "
            "a service account token or a kubeconfig, or start it with --http-auth=none",
        )

    def client() -> Any:
        from kxpu.kube.client import make_client

        return make_client()

    return ReviewAuthorizer(client)


def _pod_uid() -> str | None:
    """$POD_UID (the chart sets it from the downward API): the DRA sockets are this pod's own, so that a rolling
    update's new pod serves beside the old one (kxpu.dra.instances); unset, the fixed names."""
    return os.environ.get("POD_UID") or None


def _dra(
    daemon: Any, resource: ResourceConfig, backend: Backend, snapshot: Any, leftovers: Any = None
) -> Any:
    """The DRA half of a resource: its API client and the kubelet directories of the running config."""
    from kxpu.dra.claim_cache import ClaimCache
    from kxpu.dra.plugin import DraPlugin
    from kxpu.kube.dra import DraKube

    node = resource.dra.node_name or os.environ.get("NODE_NAME", "")
    if not node:  # checked at start; a reload may bring a DRA resource without one
        raise ValueError(
            f"{resource.name}: serving through DRA needs the node name (dra.nodeName or $NODE_NAME)"
        )
    kube = DraKube(resource.dra_driver)
    config = daemon.config
    plugin = DraPlugin(
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
        status_api=kube,
        instance=_pod_uid(),
    )
    if leftovers is not None:  # never prepare what a drained (renamed or removed) driver's claims still hold
        plugin.preparer.elsewhere = lambda: leftovers.withheld_from(resource.name)
    return plugin


def _leftovers(config: Config, node: str) -> Any:
    """The DRA drivers with claims still prepared that this config no longer serves through DRA
    (``kxpu.dra.leftover``), each served for unprepare only; None when there are none."""
    if next(config.kubelet_plugins_dir.glob("*/checkpoint.json"), None) is None:
        return None  # no DRA driver's checkpoint here: a device-plugin node never loads the DRA package
    from kxpu.dra.leftover import leftovers_for

    def make(driver: str, resource: ResourceConfig | None) -> Any:
        from kxpu.daemon.snapshot import DeviceSnapshot
        from kxpu.dra.config import DraConfig
        from kxpu.dra.leftover import NoDevices
        from kxpu.dra.plugin import DraPlugin
        from kxpu.kube.dra import DraKube

        settings = resource.dra if resource is not None else DraConfig()
        kube = DraKube(driver)
        return DraPlugin(
            resource.name if resource is not None else driver,
            driver,
            settings.node_name or node,
            NoDevices(),
            DeviceSnapshot(),
            config.kubelet_plugins_dir,
            config.plugins_registry_dir,
            kube,
            kube,
            settings,
            close=kube.close,
            status_api=kube,
            instance=_pod_uid(),
        )

    try:
        return leftovers_for(config, node, make)
    except ValueError as exc:
        _fail(str(exc))


def _grant_events() -> Any:
    """A Warning event on the pod whose container exceeds its grant (telemetry.events), through the API
    server (lightkube is imported only then; the node daemon needs events: create)."""
    from kxpu.daemon.telemetry_snapshot import GrantExceeded
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


@main.command()
@config_option
@import_option
@click.option(
    "--output",
    "-o",
    type=click.Choice(["table", "wide", "json", "yaml"]),
    default="table",
    show_default=True,
    help="table (a header, aligned columns), wide (also index, UUID, PCI bus, cores, extras and node labels), "
    "or a JSON/YAML document (README: kxpu devices).",
)
@log_level_option
def devices(config_path: Path, imports: tuple[str, ...], output: str, log_level: str) -> None:
    """Print what discovery finds for each resource, without serving anything."""
    from kxpu.devicelist import Listing, error_lines, render

    configure_logging(log_level, "text")
    config = _load(config_path, None, imports)
    listing = Listing()
    for resource in config.resources:
        listing.backends[resource.name] = resource.backend
        try:
            backend = _build_plain(resource)  # no CDI wrapper: listing devices writes no spec files
            try:
                listing.devices[resource.name] = backend.discover()
                if isinstance(backend, NodeLabeller):
                    listing.labels[resource.name] = backend.node_labels()
            finally:
                if isinstance(backend, Closable):
                    backend.close()
        except Exception as exc:
            listing.errors[resource.name] = error_text(exc)
    text = render(listing, output)
    if text:
        click.echo(text)
    if output in ("table", "wide"):
        for line in error_lines(listing.errors):
            click.echo(line, err=True)
        if not text and not listing.errors:
            click.echo("No devices found.", err=True)
    sys.exit(1 if listing.errors else 0)


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
    default=f"http://127.0.0.1:{DEFAULT_HTTP_PORT}",
    show_default=True,
    help="The node daemon's --http-address. Env: KXPU_DAEMON_URL.",
)
@click.option(
    "--token-file",
    envvar="KXPU_TOKEN_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Bearer token for the daemon's /status. Default, for a daemon on this host only: the pod's "
    "service-account token, else the kubeconfig user's token. Env: KXPU_TOKEN_FILE.",
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
    help="Default in-cluster account, else $KUBECONFIG or ~/.kube/config (its user's token, if any, is sent "
    "to the daemon).",
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
    token_file: Path | None,
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
    from kxpu.status import TokenError, format_table, node_status, status_token

    try:
        token = status_token(daemon_url, token_file, kubeconfig)
    except TokenError as exc:
        _fail(str(exc))
    result = asyncio.run(node_status(pod_resources_socket, daemon_url, all_resources, token))
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
    from kxpu.kube.client import ACCESS_ERRORS, make_client
    from kxpu.status import fetch_cluster_status, format_cluster_table

    try:
        client = make_client(kubeconfig)
    except ACCESS_ERRORS as exc:
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


def _check_api_access() -> None:
    """Exit 2 on one line when there is no way to reach the API server at all (no service account, no
    kubeconfig), as ``kxpu status --cluster`` does; an API server that does not answer is the server's
    own one-line failure (exit 1)."""
    from kxpu.kube.client import ACCESS_ERRORS, check_access

    try:
        check_access()
    except ACCESS_ERRORS as exc:
        _fail(
            f"no access to the API server: {exc}; run it in a pod with a service account, or set KUBECONFIG"
        )


def _run_server(what: str, main_task: Any) -> None:
    """Run a control-plane server until it stops; a failure (a port in use, an API server refusing) is one
    line and exit 1, its traceback only at debug level."""
    try:
        asyncio.run(main_task)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        log.debug(f"{what} failed: traceback", exc_info=exc)
        click.echo(f"kxpu: error: {what} stopped: {error_text(exc)}", err=True)
        sys.exit(1)


def _control_plane_config(path: Path | None) -> Any:
    from kxpu.sharing.control_plane import SharingConfigError, load_control_plane_config

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
@click.option(
    "--address",
    envvar="KXPU_SCHEDULER_ADDRESS",
    default="127.0.0.1:8888",
    show_default=True,
    help="[HOST]:PORT of the extender API. It binds pods and is unauthenticated: keep it on loopback, beside "
    "kube-scheduler.",
)
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
    _check_address("--address", address)
    _check_address("--metrics-address", metrics_address)
    _check_api_access()
    _run_server("the scheduler extender", serve(config, address, owner, metrics_address))


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
    _check_address("--address", address)
    _check_address("--metrics-address", metrics_address)
    for option, path in (("--tls-cert-file", tls_cert_file), ("--tls-key-file", tls_key_file)):
        try:
            path.open("rb").close()
        except OSError as exc:
            _fail(f"{option} {path}: cannot read it: {exc.strerror or exc}")
    _run_server(
        "the admission webhook",
        serve(
            families,
            config.scheduler_name,
            trusted,
            address,
            tls_cert_file,
            tls_key_file,
            metrics_address,
            config.protected_env,
            config.node_users,
            config.claim_families() if config.convert_to_claims else None,
        ),
    )


if __name__ == "__main__":
    main()
