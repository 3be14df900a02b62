"""``kxpu scheduler``: kube-scheduler's extender HTTP API over the in-memory cluster state.

Endpoints (JSON, as kube-scheduler's ``k8s.io/kube-scheduler/extender/v1`` types, which have
no JSON tags: Go writes the field names as they are, ``Pod``, ``NodeNames``, ``PodUID``, and
reads any case; we read any case too and answer with the Go names): ``POST /filter`` takes
``ExtenderArgs`` (``NodeNames`` with ``nodeCacheCapable: true``, else full ``Nodes``) and
answers every node that fits, plus ``FailedNodes`` (could fit once pods finish) and
``FailedAndUnresolvableNodes`` (no such devices; preemption cannot help). ``POST
/prioritize`` scores every node 0-10 (``[{"Host", "Score"}]``). ``POST /bind`` takes
``ExtenderBindingArgs`` (``PodName``, ``PodNamespace``, ``PodUID``, ``Node``). Also
``GET /healthz`` and ``/readyz`` (ready once the node and pod caches have synced).

``--metrics-address`` serves ``/metrics`` (``kxpu_scheduler_*``, see extender_metrics),
``/healthz`` and ``/readyz`` on a port of its own, so that the extender's API, which binds
pods, can listen on 127.0.0.1 only (beside kube-scheduler, in the same pod).

aiohttp serves it: one asyncio loop with the watch-fed cache and the API client, no
thread hand-offs, and a mature server with TLS (starlette would add uvicorn and an ASGI
layer for nothing we need).

kube-scheduler configuration (``KubeSchedulerConfiguration``)::

    extenders:
      - urlPrefix: http://127.0.0.1:8888
        filterVerb: filter
        prioritizeVerb: prioritize
        bindVerb: bind
        weight: 1
        nodeCacheCapable: true
        enableHTTPS: false
        managedResources:
          - {name: nvidia.com/gpu, ignoredByScheduler: false}
          - {name: nvidia.com/gpumem, ignoredByScheduler: true}
          - {name: nvidia.com/gpumem-percentage, ignoredByScheduler: true}
          - {name: nvidia.com/gpucores, ignoredByScheduler: true}
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Callable, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol

from aiohttp import web

from kxpu.logs import error_text, get_logger
from kxpu.sharing import bounds, probes
from kxpu.sharing import extender_metrics as metrics
from kxpu.sharing.control_plane import ControlPlaneConfig
from kxpu.sharing.lock import LockError, NodeLock
from kxpu.sharing.scheduler import LockBusy, PodRef, Scheduler, SchedulerAPI
from kxpu.sharing.state import ClusterState

log = get_logger("kxpu.sharing.extender")


def tune_gc() -> None:
    """Keep the cyclic GC off the request path: the cache is millions of long-lived objects.

    ``gc.freeze`` moves everything alive now (the synced cache) out of the collector's
    sight, and a larger young-generation threshold stops per-request allocations (a
    placement per node) from triggering full collections mid-request; p99 at 1,000
    nodes drops from ~60 ms to the p50's neighbourhood. Called after the caches sync and
    then periodically.
    """
    gc.unfreeze()  # what was frozen last time and has become cyclic garbage since is collected too
    gc.collect()
    gc.freeze()
    gc.set_threshold(200_000, 50, 100)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(data, separators=(",", ":")).encode(), status=status, content_type="application/json"
    )


def _scores_json(scores: Sequence[tuple[str, int]]) -> web.Response:
    """Prioritize's answer, ``[{"Host": ..., "Score": ...}]``, written directly.

    ``json.dumps`` of one small dict per node costs ~0.55 ms per 1,000 nodes, most of a cold
    prioritize once fits are memoized; quoting each name with the encoder json.dumps itself
    uses (same escaping, ASCII) and formatting the rest costs a quarter of that.
    """
    body = ",".join(
        [f'{{"Host":{encode_basestring_ascii(host)},"Score":{score:d}}}' for host, score in scores]
    )
    return web.Response(body=f"[{body}]".encode(), content_type="application/json")


MAX_BODY_BYTES = 64 * 1024 * 1024  # nodeCacheCapable false sends every Node object
BODY_BUDGET_BYTES = 2 * MAX_BODY_BYTES
REQUEST_TIMEOUT_S = 30.0  # kube-scheduler's extender httpTimeout in the chart
MAX_CONNECTIONS = 64  # kube-scheduler beside it keeps a few


async def _args(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, bounded as ``kxpu.sharing.bounds`` describes (one-line 4xx otherwise)."""
    app = request.app
    try:
        raw, reserved = await bounds.read_body(request, MAX_BODY_BYTES, app[BUDGET], REQUEST_TIMEOUT_S)
        try:
            if len(raw) > bounds.INLINE_BYTES:
                data = await app[PARSER].run(lambda: bounds.parse_json(raw))
            else:
                data = bounds.parse_json(raw)
        finally:
            app[BUDGET].release(reserved)
    except bounds.BodyError as exc:
        log.info("refused a request", path=request.path, status=exc.status, error=str(exc))
        raise _http_error(exc) from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text="expected a JSON object")
    return data


def _http_error(exc: bounds.BodyError) -> web.HTTPError:
    if exc.status == 413:
        return web.HTTPRequestEntityTooLarge(MAX_BODY_BYTES, MAX_BODY_BYTES + 1, text=str(exc))
    kinds: dict[int, type[web.HTTPError]] = {
        408: web.HTTPRequestTimeout,
        503: web.HTTPServiceUnavailable,
    }
    return kinds.get(exc.status, web.HTTPBadRequest)(text=str(exc))


BUDGET = web.AppKey("budget", bounds.BodyBudget)
PARSER = web.AppKey("parser", bounds.Parser)
GUARD = web.AppKey("guard", list)


def _field(args: dict[str, Any], name: str) -> Any:
    """A top-level field of an extender message, whatever its case (Go's encoding/json matches so)."""
    if name in args:
        return args[name]
    lowered = name.lower()
    for key, value in args.items():
        if key.lower() == lowered:
            return value
    return None


def _nodes(args: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]] | None]:
    """Node names, and the full node objects when kube-scheduler sent them (nodeCacheCapable false)."""
    names = _field(args, "NodeNames")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise web.HTTPBadRequest(text="NodeNames: expected a list of node names")
        return names, None
    nodes = _field(args, "Nodes") or {}
    items = nodes.get("items") if isinstance(nodes, dict) else None
    if not isinstance(nodes, dict) or not isinstance(items or [], list):
        raise web.HTTPBadRequest(text="Nodes: expected a NodeList object with items")
    items = items or []
    for n, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("metadata") or {}, dict):
            raise web.HTTPBadRequest(text=f"Nodes.items[{n}]: expected a Node object")
    return [str((item.get("metadata") or {}).get("name", "")) for item in items], items


KEY_REFRESH_S = 15.0  # how often the extender re-reads its keys and republishes the public ones

NOT_SYNCED = "kxpu scheduler: node and pod caches not synced yet; retry"


def make_app(scheduler: Scheduler, ready: Callable[[], bool] = lambda: True) -> web.Application:
    # Until the caches hold every assigned pod, devices would look emptier than they are: decide
    # nothing (kube-scheduler retries the pod) rather than over-commit.
    async def filter_(request: web.Request) -> web.Response:
        if not ready():
            return _json({"Error": NOT_SYNCED})
        args = await _args(request)
        pod = _field(args, "Pod") or {}
        names, items = _nodes(args)
        started = time.perf_counter()
        result = scheduler.filter(pod, names)
        metrics.DECISIONS.labels("fit").inc(len(result.passed))
        metrics.DECISIONS.labels("no-fit").inc(len(result.failed) + len(result.unresolvable))
        out: dict[str, Any] = {
            "FailedNodes": result.failed,
            "FailedAndUnresolvableNodes": result.unresolvable,
            "Error": result.error,
        }
        if items is None:
            out["NodeNames"] = result.passed
        else:
            keep = set(result.passed)
            out["Nodes"] = {
                "metadata": {},
                "items": [i for i in items if (i.get("metadata") or {}).get("name") in keep],
            }
        log.debug(
            "filter",
            pod=_pod_name(pod),
            nodes=len(names),
            passed=len(result.passed),
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
        metrics.REQUEST_SECONDS.labels("filter").observe(time.perf_counter() - started)
        return _json(out)

    async def prioritize(request: web.Request) -> web.Response:
        args = await _args(request)
        names, _ = _nodes(args)
        with metrics.REQUEST_SECONDS.labels("prioritize").time():
            scores = scheduler.prioritize(_field(args, "Pod") or {}, names)
        return _scores_json(scores)

    async def bind(request: web.Request) -> web.Response:
        if not ready():
            return _json({"Error": NOT_SYNCED})
        args = await _args(request)
        started = time.perf_counter()
        error = await scheduler.bind(
            str(_field(args, "PodNamespace") or ""),
            str(_field(args, "PodName") or ""),
            str(_field(args, "PodUID") or ""),
            str(_field(args, "Node") or ""),
        )
        metrics.REQUEST_SECONDS.labels("bind").observe(time.perf_counter() - started)
        metrics.DECISIONS.labels("bind-failed" if error else "bound").inc()
        return _json({"Error": error})

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(request: web.Request) -> web.Response:
        return web.Response(text="ok") if ready() else web.Response(text="caches not synced", status=503)

    guard: list[bounds.ConnectionGuard] = []  # set by serve()'s GuardedSite
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[bounds.guard_middleware(lambda: guard[0] if guard else None)],
    )
    app[BUDGET] = bounds.BodyBudget(BODY_BUDGET_BYTES)
    app[PARSER] = bounds.Parser()
    app[GUARD] = guard

    async def close_parser(app: web.Application) -> None:
        app[PARSER].close()

    app.on_cleanup.append(close_parser)
    app.router.add_post("/filter", filter_)
    app.router.add_post("/prioritize", prioritize)
    app.router.add_post("/bind", bind)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def _pod_name(pod: Any) -> str:
    meta = (pod.get("metadata") if isinstance(pod, dict) else None) or {}
    if not isinstance(meta, dict):
        return "?"
    return f"{meta.get('namespace')}/{meta.get('name')}"


class MeteredAPI:
    """The SchedulerAPI with node-lock waits and refusals counted (the decisions stay in Scheduler)."""

    def __init__(self, api: SchedulerAPI) -> None:
        self.api = api

    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        return await self.api.get_pod(namespace, name)

    async def acquire_lock(self, node: str, resource: str, pod: PodRef) -> None:
        started = time.perf_counter()
        try:
            await self.api.acquire_lock(node, resource, pod)
        except LockBusy:
            metrics.LOCK_BUSY.inc()
            raise
        finally:
            metrics.LOCK_WAIT_SECONDS.observe(time.perf_counter() - started)

    async def release_lock(self, node: str, resource: str, pod: PodRef) -> None:
        await self.api.release_lock(node, resource, pod)

    async def label_pod(self, pod: PodRef) -> None:
        await self.api.label_pod(pod)

    async def bind(self, pod: PodRef, node: str, annotations: Mapping[str, str] | None = None) -> None:
        await self.api.bind(pod, node, annotations)

    async def event(self, pod: PodRef, reason: str, message: str, warning: bool = False) -> None:
        await self.api.event(pod, reason, message, warning)


class LockSweeper(Protocol):
    async def sweep_lock(self, node: str, resource: str, text: str, in_lease: bool = False) -> str | None: ...


async def sweep_locks(
    state: ClusterState, api: LockSweeper, lock_ttl_s: float, synced: asyncio.Event
) -> None:
    """Recover node locks that no bind asks for: a pod whose Allocate never came must not hold its node.

    Only locks older than the lock timeout are looked at (a healthy one lives for one admission,
    well under a second), so a quiet cluster costs no API calls; every extender replica sweeps,
    and the compare-and-swap release makes that safe.
    """
    await synced.wait()
    interval = max(1.0, min(lock_ttl_s, 60.0) / 2)
    while True:
        await asyncio.sleep(interval)
        wall = time.time()
        held = [(n, r, t, False) for n, r, t in state.held_locks()]
        held += [(n, r, t, True) for n, r, t in state.held_leases()]
        for node, resource, text, in_lease in held:
            try:
                if wall - NodeLock.decode(text).acquired < lock_ttl_s:
                    continue
            except LockError:
                continue
            try:
                await api.sweep_lock(node, resource, text, in_lease)
            except Exception as exc:
                log.warning(
                    "could not check a node lock", node=node, resource=resource, error=error_text(exc)
                )


async def serve(config: ControlPlaneConfig, address: str, owner: str, metrics_address: str = "") -> None:
    """Run the extender until cancelled: caches from watches, keys from the Secret, HTTP on ``address``
    (and metrics and probes on ``metrics_address`` unless it is empty)."""
    from kxpu.kube.client import make_client
    from kxpu.kube.sharing.api import KubeSchedulerAPI
    from kxpu.kube.sharing.informer import Informer
    from kxpu.kube.sharing.keys import KeyStore, publish_public_keys

    client = make_client()
    keys = KeyStore([config.signing_key, *config.extra_keys], lambda: client)
    try:
        ring = await keys.load()
    except Exception as exc:
        sources = ", ".join(s.describe() for s in keys.sources)
        raise SystemExit(f"kxpu: error: cannot load the signing keys ({sources}): {exc}") from None
    if ring.signer is None:
        raise SystemExit(
            "kxpu: error: the signing keys hold no key that can sign (an Ed25519 private key or an HMAC key): "
            + ring.describe()
        )

    async def publish_keys() -> None:
        if config.public_keys_config_map is None:
            return
        try:
            await publish_public_keys(client, config.public_keys_config_map, keys.current())
        except Exception as exc:
            log.warning(
                "could not publish the public keys",
                configmap=config.public_keys_config_map,
                error=error_text(exc),
            )

    await publish_keys()
    families = config.resource_families()
    state = ClusterState([f.count for f in families], stale_after_s=config.inventory_stale_seconds)
    lease = config.node_lock == "lease"
    informer = Informer(client, state, keys.current, config.lock_namespace if lease else None)
    kube_api = KubeSchedulerAPI(
        client,
        owner,
        lock_ttl_s=config.lock_timeout_seconds,
        hard_expiry_s=config.lock_hard_expiry_seconds,
        on_takeover=lambda why: metrics.LOCK_TAKEOVERS.labels(metrics.takeover_cause(why)).inc(),
        cached=state.lock_view,
        node_lock=config.node_lock,
        lock_namespace=config.lock_namespace,
        lease_node=state.lease_node,
        cached_lease=state.lease_view,
        lease_cache_synced=lambda: informer.synced("leases"),
    )
    api = MeteredAPI(kube_api)
    scheduler = Scheduler(state, families, keys.current, api, config.node_policy, config.device_policy)
    metrics.CACHE.state = state
    metrics.CACHE.ready = lambda: informer.ready
    app = make_app(scheduler, lambda: informer.ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = probes.parse_listen(address)
    if host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "the extender's API (it binds pods) listens beyond loopback, unauthenticated; "
            "only kube-scheduler should reach it",
            address=address,
        )
    site = bounds.GuardedSite(
        runner, host, port, max_connections=MAX_CONNECTIONS, request_timeout_s=REQUEST_TIMEOUT_S
    )
    app[GUARD].append(site.guard)
    await site.start()
    log.info("scheduler extender listening", address=address, families=[f.count for f in families])
    probe_runner: web.AppRunner | None = None
    if metrics_address:
        app = probes.make_probe_app(lambda: informer.ready, "caches not synced")
        probe_runner, _ = await probes.start(app, metrics_address)
        log.info("serving metrics and probes", address=metrics_address)

    async def housekeeping() -> None:
        await informer.synced_event.wait()
        while True:
            tune_gc()
            await asyncio.sleep(300)

    async def refresh_keys() -> None:
        # a rotation reaches the signer, and the nodes through the published public keys, within this
        while True:
            await asyncio.sleep(KEY_REFRESH_S)
            try:
                await keys.load()
            except Exception as exc:
                log.warning("could not reload the signing keys; using the last ones", error=error_text(exc))
            await publish_keys()

    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(informer.run())
            tasks.create_task(housekeeping())
            tasks.create_task(refresh_keys())
            tasks.create_task(
                sweep_locks(state, kube_api, config.lock_timeout_seconds, informer.synced_event)
            )
    finally:
        await runner.cleanup()
        if probe_runner is not None:
            await probe_runner.cleanup()
