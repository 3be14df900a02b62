"""``kxpu webhook``: admission for pods that ask for shared devices (AdmissionReview v1 over HTTPS).

``POST /mutate`` (MutatingWebhookConfiguration), for a pod asking for any configured
family:

- sets ``spec.schedulerName`` to the kxpu scheduler (when it is empty or
  ``default-scheduler``; a pod naming another scheduler keeps it);
- labels it ``kxpu.io/assigned=true``, the label the scheduler's pod watch selects on: set
  here, the scheduler can bind with the assignment in one request (the Binding's
  annotations land on the pod), instead of labelling the pod at bind first;
- adds the count resource (``default_count``) to containers that name only memory,
  a percentage or cores: without it the kubelet would never call the device plugin,
  and kube-scheduler would not count a slot.

``POST /validate`` (ValidatingWebhookConfiguration) denies:

- a pod created with kxpu's own annotations (``kxpu.io/assignment``, its signature,
  ``kxpu.io/bind-phase``, ``kxpu.io/allocated.*``, ``kxpu.io/lock.*``), or an update
  changing them or the ``kxpu.io/assigned`` label by anyone but the trusted users (the
  scheduler's and node daemon's service accounts). Defence in depth: a forged assignment
  would not verify anyway;
- privileged containers asking for shared devices (they see every device, so no limit
  would hold);
- impossible requests (cores > 100, a percentage over 100, memory and a percentage
  together, init containers asking for shared devices, …) with the reason;
- pods with ``spec.nodeName`` preset that ask for shared devices (no scheduler decision,
  no assignment: the node would refuse them at admission anyway).

With ``convertToClaims`` (the DRA path, ``kxpu.sharing.claims``), ``/mutate`` instead turns a pod's
shared-device limits into consumable-capacity ResourceClaims (from ResourceClaimTemplates it makes before
answering, none in a dry run: register it with ``sideEffects: NoneOnDryRun``) for the stock kube-scheduler and
denies what a claim cannot express, and ``/validate`` denies a pod that still asks for shared devices (the
mutating webhook never saw it). The privileged, protected-env and nodeName checks hold on both paths.

Metrics (``kxpu_webhook_*``, see webhook_metrics) and ``/healthz``, ``/readyz`` are served
in plain HTTP on ``--metrics-address``: the admission port's certificate is for the API server.

TLS: the certificate and key are files (mount the Secret holding them, e.g. one made by
cert-manager); they are re-read when they change, so rotation needs no restart.

Recommended ``failurePolicy``: ``Fail`` for both, with a ``namespaceSelector`` that
leaves out ``kube-system`` and the kxpu namespace (so kxpu can always start) and an
``objectSelector``-free rule on pods CREATE (mutating) and CREATE/UPDATE (validating), the
validating one on ``pods/status`` too (the API server takes label and annotation changes through
it), with a ``matchConditions`` entry that sends a status update only when it changes them.
With ``Ignore``, a pod admitted while the webhook is down reaches the default scheduler
and then fails admission on the node with a clear "no verified assignment" error and
event; nothing is ever over-committed either way, ``Fail`` just fails earlier and louder.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from kxpu.kube.sharing.templates import TemplateError
from kxpu.logs import get_logger
from kxpu.sharing import bounds, probes
from kxpu.sharing import webhook_metrics as metrics
from kxpu.sharing.claims import ClaimFamily, Template, convert
from kxpu.sharing.control_plane import DEFAULT_PROTECTED_ENV
from kxpu.sharing.lock import ALLOCATED_PREFIX, ASSIGNED_POD_LABEL, BIND_PHASE_ANNOTATION, LOCK_PREFIX
from kxpu.sharing.requests import (
    RequestError,
    ResourceFamily,
    check_containers,
    check_pod_shape,
    parse_pod,
    requested_names,
)
from kxpu.sharing.signing import ASSIGNMENT_ANNOTATION, SIGNATURE_ANNOTATION

log = get_logger("kxpu.sharing.webhook")

DEFAULT_SCHEDULER = "default-scheduler"
# userInfo.extra of a bound service-account token issued for a pod: the node that pod runs on
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
_RESERVED_EXACT = frozenset({ASSIGNMENT_ANNOTATION, SIGNATURE_ANNOTATION, BIND_PHASE_ANNOTATION})


def reserved(annotation: str) -> bool:
    return annotation in _RESERVED_EXACT or annotation.startswith((ALLOCATED_PREFIX, LOCK_PREFIX))


def _escape(segment: str) -> str:
    return segment.replace("~", "~0").replace("/", "~1")


def _asks(pod: Mapping[str, Any], families: Sequence[ResourceFamily]) -> bool:
    names = requested_names(families)
    spec = pod.get("spec") or {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        if names & (set(resources.get("limits") or {}) | set(resources.get("requests") or {})):
            return True
    return False


def mutate(
    pod: Mapping[str, Any], families: Sequence[ResourceFamily], scheduler_name: str
) -> list[dict[str, Any]]:
    """JSONPatch operations for a pod (empty: nothing to change)."""
    if not _asks(pod, families):
        return []
    ops: list[dict[str, Any]] = []
    spec = pod.get("spec") or {}
    if spec.get("schedulerName") in (None, "", DEFAULT_SCHEDULER):
        ops.append({"op": "add", "path": "/spec/schedulerName", "value": scheduler_name})
    if spec.get("schedulerName") in (None, "", DEFAULT_SCHEDULER, scheduler_name):
        labels = (pod.get("metadata") or {}).get("labels")
        if not isinstance(labels, dict):
            ops.append({"op": "add", "path": "/metadata/labels", "value": {ASSIGNED_POD_LABEL: "true"}})
        elif labels.get(ASSIGNED_POD_LABEL) != "true":
            path = f"/metadata/labels/{_escape(ASSIGNED_POD_LABEL)}"
            ops.append({"op": "add", "path": path, "value": "true"})
    for n, container in enumerate(spec.get("containers") or []):
        resources = container.get("resources")
        has_resources = resources is not None
        has_limits = isinstance((resources or {}).get("limits"), dict)
        named = set((resources or {}).get("limits") or {}) | set((resources or {}).get("requests") or {})
        for family in families:
            companions = {family.memory, family.memory_percentage, family.cores}
            if family.count in named or not companions & named:
                continue
            if not has_resources:
                ops.append({"op": "add", "path": f"/spec/containers/{n}/resources", "value": {}})
                has_resources = True
            if not has_limits:
                ops.append({"op": "add", "path": f"/spec/containers/{n}/resources/limits", "value": {}})
                has_limits = True
            path = f"/spec/containers/{n}/resources/limits/{_escape(family.count)}"
            ops.append({"op": "add", "path": path, "value": str(family.default_count)})
            named.add(family.count)
    return ops


def node_may_write(annotation: str, value: str | None) -> bool:
    """Whether the node daemon may set ``annotation`` to ``value`` on a pod: its allocated mark, nothing else."""
    if annotation.startswith(ALLOCATED_PREFIX):
        return value is not None
    return annotation == BIND_PHASE_ANNOTATION and value == "allocated"


def _node_update(
    request: Mapping[str, Any], changed: Sequence[str], annotations: Mapping[str, str]
) -> str | None:
    """Why a node daemon's change of kxpu's annotations is denied (None: it only marks its own pod allocated)."""
    beyond = [a for a in changed if not node_may_write(a, annotations.get(a))]
    if beyond:
        return (
            f"the kxpu node daemon may only set {ALLOCATED_PREFIX}* and {BIND_PHASE_ANNOTATION}=allocated, "
            f"not change {', '.join(beyond)}"
        )
    old_spec = (request.get("oldObject") or {}).get("spec") or {}
    bound = str(old_spec.get("nodeName") or "")
    if not bound:
        return "the kxpu node daemon may only mark pods bound to a node"
    extra = (request.get("userInfo") or {}).get("extra") or {}
    claimed = extra.get(NODE_NAME_EXTRA) if isinstance(extra, dict) else None
    if isinstance(claimed, list) and claimed and bound not in claimed:
        shown = ", ".join(str(c)[:253] for c in claimed[:2])
        return f"the kxpu node daemon of node {shown} may not mark a pod bound to node {bound[:253]}"
    return None


def validate(
    request: Mapping[str, Any],
    families: Sequence[ResourceFamily],
    trusted_users: Sequence[str],
    scheduler_name: str | None = None,
    protected_env: Sequence[str] = DEFAULT_PROTECTED_ENV,
    node_users: Sequence[str] = (),
) -> str | None:
    """Why an admission request must be denied (None: allowed).

    ``trusted_users`` (the extender) may change kxpu's annotations and label; ``node_users`` (the node
    daemon) only set the allocated mark, on a pod bound to a node (its own node, when its token names one).
    """
    pod = request.get("object") or {}
    old = request.get("oldObject") or {}
    user = str((request.get("userInfo") or {}).get("username", ""))
    if user in node_users:  # listed as trusted too (an older config): still only the node daemon's rights
        trusted_users = [u for u in trusted_users if u != user]
    operation = request.get("operation")
    annotations: Mapping[str, str] = (pod.get("metadata") or {}).get("annotations") or {}
    old_annotations: Mapping[str, str] = (old.get("metadata") or {}).get("annotations") or {}
    label = ((pod.get("metadata") or {}).get("labels") or {}).get(ASSIGNED_POD_LABEL)
    old_label = ((old.get("metadata") or {}).get("labels") or {}).get(ASSIGNED_POD_LABEL)
    if user not in trusted_users and operation == "UPDATE" and label != old_label:
        # Removing it would hide the pod from the scheduler's bookkeeping: its grant would look free.
        # (At CREATE anyone may set it, /mutate does: it only makes the scheduler watch the pod.)
        return f"only the kxpu scheduler may set or remove the {ASSIGNED_POD_LABEL} label"
    if user not in trusted_users:
        if operation == "CREATE":
            carried = sorted(a for a in annotations if reserved(a))
            if carried:
                return f"pods may not carry kxpu's own annotations ({', '.join(carried)}); the scheduler writes them"
        elif operation == "UPDATE":
            changed = sorted(
                a
                for a in set(annotations) | set(old_annotations)
                if reserved(a) and annotations.get(a) != old_annotations.get(a)
            )
            if changed and user in node_users:
                why = _node_update(request, changed, annotations)
                if why:
                    return why
            elif changed:
                return f"only the kxpu scheduler and node daemon may change {', '.join(changed)}"
    if operation != "CREATE" or not _asks(pod, families):
        return None
    spec = pod.get("spec") or {}
    try:
        check_containers(
            spec, requested_names(families), protected_env, "kxpu sets from the pod's assignment"
        )
    except RequestError as exc:
        return str(exc)
    if spec.get("nodeName"):
        return (
            "pods asking for shared devices must be scheduled by the kxpu scheduler, not have nodeName preset"
        )
    try:
        parse_pod(pod, families)
    except RequestError as exc:
        return str(exc)
    if scheduler_name is not None and spec.get("schedulerName") != scheduler_name:
        # Another scheduler would place it without an assignment; on the node it could be taken for
        # the pod the node lock names and be handed that pod's grant.
        return (
            f"pods asking for shared devices must use schedulerName {scheduler_name!r}, "
            f"not {spec.get('schedulerName')!r}"
        )
    return None


def _review(
    request: Mapping[str, Any], allowed: bool, message: str = "", patch: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": allowed}
    if message:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": message}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


MAX_BODY_BYTES = 3 * 1024 * 1024 + 256 * 1024
# The API server stores a pod of at most 1.5 MiB (etcd's default request limit); an UPDATE review carries the
# pod and its old copy, so 3 MiB of pods plus the review's envelope. Anything larger is no review from it.
BODY_BUDGET_BYTES = 16 * 1024 * 1024  # large bodies in flight at once: well under the chart's 256 Mi limit
REQUEST_TIMEOUT_S = 10.0  # headers, then body, each within this; the API server gives up after 5 s (chart)
# Each TLS connection holds asyncio's 256 KiB buffer: 128 are 32 MiB. One client address (a pod) gets half,
# so it cannot take every connection from the API server.
MAX_CONNECTIONS = 128
MAX_PER_PEER = 64


def make_app(
    families: Sequence[ResourceFamily],
    scheduler_name: str,
    trusted_users: Sequence[str] = (),
    protected_env: Sequence[str] = DEFAULT_PROTECTED_ENV,
    node_users: Sequence[str] = (),
    *,
    claims: Sequence[ClaimFamily] | None = None,
    templates: TemplateMaker | None = None,
    max_body: int = MAX_BODY_BYTES,
    body_budget: int = BODY_BUDGET_BYTES,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
) -> web.Application:
    """The admission app; bodies are bounded as ``kxpu.sharing.bounds`` describes.

    ``claims`` (the DRA path, ``convertToClaims``): ``/mutate`` turns shared-device limits into claims
    (``kxpu.sharing.claims``) and ``templates`` makes the ResourceClaimTemplates they name before the answer.
    """
    if claims is not None and templates is None:
        raise ValueError("converting pods to claims needs a template maker")
    budget = bounds.BodyBudget(body_budget)
    parser = bounds.Parser()
    guard: list[bounds.ConnectionGuard] = []  # set by serve()'s GuardedSite

    def body(raw: bytes) -> dict[str, Any]:
        review = bounds.parse_json(raw)
        inner = review.get("request") if isinstance(review, dict) else None
        if not isinstance(inner, dict):
            raise bounds.BodyError(400, "expected an AdmissionReview with a request")
        for field in ("kind", "userInfo"):
            if not isinstance(inner.get(field) or {}, dict):
                raise bounds.BodyError(400, f"request.{field}: expected an object")
        return inner

    def malformed(review: dict[str, Any]) -> str | None:
        """Why the review's pod objects are not shaped as Kubernetes writes pods (None: they are)."""
        for field in ("object", "oldObject"):
            if review.get(field) is None:
                continue
            try:
                check_pod_shape(review[field])
            except RequestError as exc:
                return f"malformed request.{field}: {exc}"
        return None

    def convert_(review: dict[str, Any], started: float) -> Work:
        assert claims is not None
        try:
            done = convert(
                review.get("object") or {},
                str(review.get("namespace") or ""),
                claims,
                protected_env,
                scheduler_name,
            )
        except RequestError as exc:
            log.info("denied", pod=_name(review), reason=str(exc))
            return _answer("mutate", started, _review(review, False, str(exc)), "denied", "bad-request"), []
        if not done.patch:
            return _answer("mutate", started, _review(review, True), "allowed", "no-change"), []
        log.info("converted to claims", pod=_name(review), templates=[t.name for t in done.templates])
        answer = _answer("mutate", started, _review(review, True, patch=done.patch), "patched", "claims")
        # a dry run (kubectl --dry-run=server) must change nothing: the API server is told NoneOnDryRun
        return answer, [] if review.get("dryRun") else done.templates

    def mutate_(raw: bytes) -> Work:
        review = body(raw)
        started = time.perf_counter()
        if (review.get("kind") or {}).get("kind") != "Pod" or review.get("operation") != "CREATE":
            return _answer("mutate", started, _review(review, True), "allowed", "not-a-pod-create"), []
        bad = malformed(review)
        if bad:
            return _answer("mutate", started, _review(review, False, bad), "denied", "malformed"), []
        if claims is not None:
            return convert_(review, started)
        patch = mutate(review.get("object") or {}, families, scheduler_name)
        if patch:
            log.info("mutated", pod=_name(review), ops=len(patch))
            answer = _answer(
                "mutate", started, _review(review, True, patch=patch), "patched", "shared-devices"
            )
            return answer, []
        return _answer("mutate", started, _review(review, True), "allowed", "no-change"), []

    def validate_(raw: bytes) -> Work:
        review = body(raw)
        started = time.perf_counter()
        if (review.get("kind") or {}).get("kind") != "Pod":
            return _answer("validate", started, _review(review, True), "allowed", "not-a-pod"), []
        bad = malformed(review)
        if bad:
            return _answer("validate", started, _review(review, False, bad), "denied", "malformed"), []
        # convertToClaims: a converted pod asks for no shared name any more; kxpu's annotations and label stay
        # guarded (pods the extender placed keep running while the cluster moves, and count by them)
        reason = (_unconverted(review, families) if claims is not None else None) or validate(
            review,
            families,
            trusted_users,
            scheduler_name if claims is None else None,
            protected_env,
            node_users,
        )
        if reason:
            log.info("denied", pod=_name(review), reason=reason)
            answer = _review(review, False, reason)
            return _answer("validate", started, answer, "denied", metrics.reason_of(reason)), []
        return _answer("validate", started, _review(review, True), "allowed", "valid"), []

    async def make_templates(answer: dict[str, Any], pending: Sequence[Template]) -> dict[str, Any]:
        """The answer, once the templates it names exist; a denial saying why when they cannot be made."""
        assert templates is not None
        try:
            await templates(pending)
        except TemplateError as exc:
            log.warning("denied: no claim template", error=str(exc))
            metrics.ADMISSIONS.labels("mutate", "denied", "template").inc()
            response = answer["response"]
            return _review(
                {"uid": response.get("uid", "")}, False, f"{exc} (the pod was not admitted: retry)"
            )
        return answer

    def endpoint(
        name: str, work: Callable[[bytes], Work]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            reserved = 0
            try:
                raw, reserved = await bounds.read_body(request, max_body, budget, request_timeout_s)
                # large: parsed and answered on the worker thread, so small reviews keep being answered
                if len(raw) > bounds.INLINE_BYTES:
                    answer, pending = await parser.run(lambda: work(raw))
                else:
                    answer, pending = work(raw)
                if pending:
                    answer = await make_templates(answer, pending)
            except bounds.BodyError as exc:
                metrics.REFUSED.labels(name, str(exc.status)).inc()
                log.info("refused a request", webhook=name, status=exc.status, error=str(exc))
                return web.Response(status=exc.status, text=str(exc))
            finally:
                budget.release(reserved)
            return web.Response(body=json.dumps(answer).encode(), content_type="application/json")

        return handle

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def close_parser(app: web.Application) -> None:
        parser.close()

    # read_body enforces the limit itself; aiohttp's own check (client_max_size) would only apply to read()
    app = web.Application(
        client_max_size=max_body,
        middlewares=[bounds.guard_middleware(lambda: guard[0] if guard else None)],
    )
    app[GUARD] = guard
    app.on_cleanup.append(close_parser)
    app.router.add_post("/mutate", endpoint("mutate", mutate_))
    app.router.add_post("/validate", endpoint("validate", validate_))
    app.router.add_get("/healthz", healthz)
    return app


GUARD = web.AppKey("guard", list)
# An admission answer, and the claim templates that must exist before it is sent (the DRA path's).
Work = tuple[dict[str, Any], Sequence[Template]]
TemplateMaker = Callable[[Sequence[Template]], Awaitable[None]]


def _unconverted(review: Mapping[str, Any], families: Sequence[ResourceFamily]) -> str | None:
    """On the DRA path: a pod still asking for shared devices after the mutating webhook was not converted
    (that webhook was skipped or failed open): no device plugin serves those names, so it could never run."""
    if review.get("operation") != "CREATE" or not _asks(review.get("object") or {}, families):
        return None
    return (
        "pods asking for shared devices are converted to ResourceClaims by kxpu's mutating webhook, which did "
        "not convert this one: check that the MutatingWebhookConfiguration reaches the webhook"
    )


def _answer(
    webhook: str, started: float, review: dict[str, Any], verdict: str, reason: str
) -> dict[str, Any]:
    metrics.ADMISSIONS.labels(webhook, verdict, reason).inc()
    metrics.ADMISSION_SECONDS.labels(webhook).observe(time.perf_counter() - started)
    return review


def _name(review: Mapping[str, Any]) -> str:
    meta = (review.get("object") or {}).get("metadata") or {}
    return f"{review.get('namespace')}/{review.get('name') or meta.get('generateName', '')}"


class ReloadingTLS:
    """A server SSL context whose certificate is re-read when the files change.

    ``context`` is what the server listens with; on every ClientHello the connection is
    switched to a context loaded from the current files (re-read only when their mtimes move).
    """

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self._stamp: tuple[float, float] | None = None
        self._active = self._load()
        self.context = self._active
        self.context.sni_callback = self._on_hello

    def _new_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def _load(self) -> ssl.SSLContext:
        stamp = (self.cert.stat().st_mtime, self.key.stat().st_mtime)
        context = self._new_context()
        context.load_cert_chain(self.cert, self.key)
        self._stamp = stamp
        log.info("TLS certificate loaded", cert=str(self.cert))
        metrics.TLS_RELOADS.labels("ok").inc()
        return context

    def current(self) -> ssl.SSLContext:
        try:
            if (self.cert.stat().st_mtime, self.key.stat().st_mtime) != self._stamp:
                self._active = self._load()
        except (OSError, ssl.SSLError) as exc:  # keep serving with the last good certificate
            log.warning("TLS certificate reload failed", error=str(exc))
            metrics.TLS_RELOADS.labels("failed").inc()
        return self._active

    def _on_hello(self, sock: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        active = self.current()
        if active is not context:
            sock.context = active


async def serve(
    families: Sequence[ResourceFamily],
    scheduler_name: str,
    trusted_users: Sequence[str],
    address: str,
    cert: Path,
    key: Path,
    metrics_address: str = "",
    protected_env: Sequence[str] = DEFAULT_PROTECTED_ENV,
    node_users: Sequence[str] = (),
    claims: Sequence[ClaimFamily] | None = None,
) -> None:
    """Serve HTTPS on ``address`` (and plain-HTTP metrics and probes on ``metrics_address``) until cancelled;
    with ``claims``, converting shared-device pods to DRA claims (the API client is made here)."""
    tls = ReloadingTLS(cert, key)
    maker: TemplateMaker | None = None
    if claims is not None:
        from kxpu.kube.sharing.templates import TemplateStore

        maker = TemplateStore().ensure
    app = make_app(
        families, scheduler_name, trusted_users, protected_env, node_users, claims=claims, templates=maker
    )
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=REQUEST_TIMEOUT_S)
    await runner.setup()
    host, port = probes.parse_listen(address)
    site = bounds.GuardedSite(
        runner,
        host,
        port,
        ssl_context=tls.context,
        max_connections=MAX_CONNECTIONS,
        max_per_peer=MAX_PER_PEER,
        request_timeout_s=REQUEST_TIMEOUT_S,
    )
    app[GUARD].append(site.guard)
    await site.start()
    log.info(
        "admission webhook listening",
        address=address,
        scheduler=scheduler_name if claims is None else "(DRA: pods are converted to claims)",
    )
    probe_runner: web.AppRunner | None = None
    if metrics_address:
        probe_runner, _ = await probes.start(probes.make_probe_app(lambda: True), metrics_address)
        log.info("serving metrics and probes", address=metrics_address)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        if probe_runner is not None:
            await probe_runner.cleanup()
