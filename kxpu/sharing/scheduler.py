"""The extender's decisions: filter, prioritize and bind over the in-memory cluster state.

HTTP lives in ``extender.py``; the API server behind the ``SchedulerAPI`` protocol
(``kxpu.kube.sharing.api`` for real, a fake in tests). Filter and prioritize only read
the state; fits are memoized by request shape and node version, so prioritize reuses
filter's work and the next replica of a Deployment reuses every fit on nodes that did not
change. Bind decides again — authoritatively, under a per-node mutex and
against usage that includes earlier binds — because kube-scheduler filters the next pod
while it still binds the previous one.

Bind trusts nothing a request carried but the names it checks (``placement.check_names``): the
pod is read from the API server (the body sent to filter could say anything), its UID must be
the one asked for, it must ask for shared devices, and the node must be one it may run on
(``placement.why_not_on``); the grant is fitted to what the pod itself requests.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kxpu.logs import get_logger
from kxpu.sharing.fit import Misfit, fit_pod, fit_scorer
from kxpu.sharing.lock import ASSIGNED_POD_LABEL
from kxpu.sharing.lock import BIND_PHASE_ANNOTATION as BIND_PHASE_ANNOTATION  # re-exported
from kxpu.sharing.model import Assignment, PodRequest, Policy
from kxpu.sharing.placement import check_names, why_not_on
from kxpu.sharing.requests import RequestError, ResourceFamily, parse_pod
from kxpu.sharing.signing import (
    ASSIGNMENT_ANNOTATION,
    SIGNATURE_ANNOTATION,
    Keys,
    SignatureError,
    encode_assignment,
    sign,
    verify,
)
from kxpu.sharing.state import ClusterState

log = get_logger("kxpu.sharing.scheduler")

_MEMO_SHAPES = 8
_UNKNOWN = Misfit("node unknown to the kxpu scheduler (no inventory seen)")


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class LockBusy(Exception):
    """Another pod holds the node lock for a family (it is between bind and allocate)."""


class SchedulerAPI(Protocol):
    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]: ...

    async def acquire_lock(self, node: str, resource: str, pod: PodRef) -> None:
        """Take the node lock for ``resource`` or raise LockBusy."""

    async def release_lock(self, node: str, resource: str, pod: PodRef) -> None:
        """Drop the lock if ``pod`` still holds it."""

    async def label_pod(self, pod: PodRef) -> None:
        """Add the label the scheduler's pod watch selects on (when the webhook did not)."""

    async def bind(self, pod: PodRef, node: str, annotations: Mapping[str, str] | None = None) -> None:
        """Bind, setting ``annotations`` on the pod in the same write (the API server copies them)."""

    async def event(self, pod: PodRef, reason: str, message: str, warning: bool = False) -> None: ...


@dataclass(frozen=True, slots=True)
class FilterResult:
    passed: list[str]
    failed: dict[str, str]  # may fit once other pods finish (preemption can help)
    unresolvable: dict[str, str]  # no such devices at all
    error: str = ""


class Scheduler:
    def __init__(
        self,
        state: ClusterState,
        families: Sequence[ResourceFamily],
        keys: Callable[[], Keys],
        api: SchedulerAPI | None = None,
        node_policy: Policy = Policy.BINPACK,
        device_policy: Policy = Policy.SPREAD,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.families = tuple(families)
        self.keys = keys
        self.api = api
        self.node_policy = node_policy
        self.device_policy = device_policy
        self.clock = clock
        self._memo: OrderedDict[tuple[PodRequest, ...], dict[str, tuple[int, float | Misfit]]] = OrderedDict()
        self._node_mutex: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Task[None]] = set()

    def requests(self, pod: Mapping[str, Any]) -> list[PodRequest]:
        return parse_pod(pod, self.families)

    def _memo_for(self, requests: Sequence[PodRequest]) -> dict[str, tuple[int, float | Misfit]]:
        """Scores or misfits by node for one request *shape* (frozen PodRequests), each at a node version.

        A fit is a pure function of the request, the node's state and the policies, so the
        next pod of a Deployment reuses every fit on nodes that did not change since; the
        few most recent shapes are kept.
        """
        key = tuple(requests)
        memo = self._memo.get(key)
        if memo is None:
            memo = self._memo[key] = {}
            while len(self._memo) > _MEMO_SHAPES:
                self._memo.pop(next(iter(self._memo)))
        else:
            self._memo.move_to_end(key)
        return memo

    def _fit_nodes(self, requests: Sequence[PodRequest], nodes: Sequence[str]) -> list[float | Misfit]:
        """Each node's score for the pod, or why it does not fit: ``fit_pod``'s answers without its grants.

        Filter and prioritize use no grants (bind fits again, against current usage), so they
        take ``fit_scorer``, which answers the common pod without choosing devices.
        """
        memo = self._memo_for(requests)
        score = fit_scorer(requests, self.node_policy, self.device_policy)
        out: list[float | Misfit] = []
        for name, state in zip(nodes, self.state.nodes(nodes), strict=True):
            if state is None:
                out.append(_UNKNOWN)
                continue
            hit = memo.get(name)
            if hit is not None and hit[0] == state.version:
                out.append(hit[1])
                continue
            result = score(state)
            if state.version >= 0:
                memo[name] = (state.version, result)
            out.append(result)
        return out

    def filter(self, pod: Mapping[str, Any], nodes: Sequence[str]) -> FilterResult:
        try:
            requests = self.requests(pod)
        except RequestError as exc:
            return FilterResult([], {}, dict.fromkeys(nodes, str(exc)), error="")
        if not requests:
            return FilterResult(list(nodes), {}, {})
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        for node, result in zip(nodes, self._fit_nodes(requests, nodes), strict=True):
            if not isinstance(result, Misfit):
                passed.append(node)
            elif result.reason.startswith(("no ", "node unknown")):
                unresolvable[node] = result.reason
            else:
                failed[node] = result.reason
        return FilterResult(passed, failed, unresolvable)

    def prioritize(self, pod: Mapping[str, Any], nodes: Sequence[str]) -> list[tuple[str, int]]:
        try:
            requests = self.requests(pod)
        except RequestError:
            return [(n, 0) for n in nodes]
        if not requests:
            return [(n, 0) for n in nodes]
        # A node whose lock a pod holds (bound, not yet allocated) scores 0: kube-scheduler binds this pod
        # elsewhere rather than into a LockBusy and a retry (in a burst, binpack would aim every pod at it).
        # Scores come from policy.node_score, 0-10 already, and rounding keeps them there: no clamp (min and
        # max per node were a third of a cold prioritize).
        locked = self.state.locked
        return [
            (node, 0 if isinstance(result, Misfit) or locked(node) else round(result))
            for node, result in zip(nodes, self._fit_nodes(requests, nodes), strict=True)
        ]

    def decide(self, pod: Mapping[str, Any], node: str) -> Assignment | Misfit | None:
        """Bind's decision against current usage (None: the pod asks for no shared devices)."""
        requests = self.requests(pod)
        if not requests:
            return None
        state = self.state.node(node)
        if state is None:
            return Misfit(f"node {node} has no kxpu inventory")
        result = fit_pod(requests, state, self.node_policy, self.device_policy)
        if isinstance(result, Misfit):
            return result
        meta = pod.get("metadata") or {}
        return Assignment(
            pod_uid=str(meta.get("uid", "")),
            namespace=str(meta.get("namespace", "default")),
            name=str(meta.get("name", "")),
            node=node,
            containers=result.containers,
            issued_at=int(self.clock()),
        )

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Bind with a signed assignment; '' on success, else the error kube-scheduler shows (one line)."""
        if self.api is None:
            return "the extender has no API client to bind with"
        bad = check_names(namespace, name, node)
        if bad:
            return f"bind refused: {bad}"
        if not uid:
            return "bind refused: PodUID is empty (kube-scheduler always sends the pod's UID)"
        ref = PodRef(namespace, name, uid)
        # Always the API server's pod: what /filter was sent is whatever its caller wrote.
        try:
            pod = await self.api.get_pod(namespace, name)
        except Exception as exc:
            return f"cannot read pod {ref}: {str(exc)[:300]}"
        actual_uid = str((pod.get("metadata") or {}).get("uid", ""))
        if actual_uid != uid:
            return f"pod {ref} was replaced (UID {actual_uid}, binding asked for {uid})"
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to:
            # kube-scheduler retries a bind whose answer it gave up waiting for, though it may have succeeded
            if self._earlier_bind(pod, node) is not None:
                return ""
            return f"pod {ref} is already bound to {bound_to}"
        facts = self.state.node_facts(node)
        if facts is None:
            return f"bind refused: node {node} is unknown to the kxpu scheduler (no such sharing node)"
        why = why_not_on(pod, node, facts)
        if why:
            return f"bind refused: pod {ref} may not run on {node}: {why}"
        mutex = self._node_mutex.setdefault(node, asyncio.Lock())
        async with mutex:
            try:
                decision = self.decide(pod, node)
            except RequestError as exc:
                return f"pod {ref}: {exc}"
            if decision is None:
                # kube-scheduler sends only pods asking for managed resources: anything else is not its request
                return f"bind refused: pod {ref} asks for no shared devices; kxpu binds only pods that do"
            if isinstance(decision, Misfit):
                return f"pod {ref} no longer fits {node}: {decision.reason}"
            labelled = ((pod.get("metadata") or {}).get("labels") or {}).get(ASSIGNED_POD_LABEL) == "true"
            return await self._bind_assigned(ref, node, decision, labelled)

    async def _bind_assigned(self, ref: PodRef, node: str, assignment: Assignment, labelled: bool) -> str:
        """Lock, then bind with the signed assignment as the Binding's annotations: one write for both.

        The pod is never seen bound without its assignment, nor with an assignment and unbound, so a
        failed bind leaves nothing on the pod to clear. ``labelled``: the webhook set the watch label
        (only kxpu can remove it); if not, it is added first, or the pod watch would never see the grant.
        """
        assert self.api is not None
        if not labelled:
            try:
                await self.api.label_pod(ref)
            except Exception as exc:
                return f"cannot label pod {ref} for kxpu's pod watch: {exc}"
        locked: list[str] = []
        self.state.assume(assignment)
        try:
            for resource in sorted(assignment.resources):
                await self.api.acquire_lock(node, resource, ref)
                locked.append(resource)
                self.state.mark_locked(node)
            annotations = {
                ASSIGNMENT_ANNOTATION: encode_assignment(assignment),
                SIGNATURE_ANNOTATION: sign(assignment, self.keys()),
                BIND_PHASE_ANNOTATION: "allocating",
            }
            await self.api.bind(ref, node, annotations)
        except Exception as exc:
            self.state.forget(ref.uid)
            earlier = None if isinstance(exc, LockBusy) else await self._read_earlier_bind(ref, node)
            if earlier is not None:
                # A retry that raced the bind it retries (kube-scheduler gave up waiting for it): that one
                # succeeded, so its grant and the lock (re-taken by this same pod) stand.
                self.state.assume(earlier)
                log.info("bind retried after it succeeded", pod=str(ref), node=node)
                return ""
            for resource in locked:
                try:
                    await self.api.release_lock(node, resource, ref)
                except Exception as release_exc:
                    log.warning(
                        "could not release a node lock", node=node, pod=str(ref), error=str(release_exc)
                    )
            what = "node is locked" if isinstance(exc, LockBusy) else "bind failed"
            log.info(what, pod=str(ref), node=node, error=str(exc))
            return f"binding {ref} to {node}: {exc}"
        devices = {c.container: [g.device for g in c.devices] for c in assignment.containers}
        log.info("bound", pod=str(ref), node=node, devices=devices)
        summary = "; ".join(
            f"{c.container}: "
            + ", ".join(f"{g.device} ({g.memory_mib} MiB, {g.cores}% cores)" for g in c.devices)
            for c in assignment.containers
        )
        # Off the bind's path: kube-scheduler's next binding waits for this answer, not for the event.
        task = asyncio.create_task(self._event(ref, "KxpuAssigned", f"assigned on {node}: {summary}"))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return ""

    def _earlier_bind(self, pod: Mapping[str, Any], node: str) -> Assignment | None:
        """The assignment a bind already gave ``pod`` on ``node`` (bound there, signed by our keys), if any."""
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if (pod.get("spec") or {}).get("nodeName") != node or ASSIGNMENT_ANNOTATION not in annotations:
            return None
        try:
            return verify(
                annotations.get(ASSIGNMENT_ANNOTATION),
                annotations.get(SIGNATURE_ANNOTATION),
                self.keys(),
                pod_uid=str(meta.get("uid", "")),
                namespace=str(meta.get("namespace", "")),
                name=str(meta.get("name", "")),
                node=node,
                now=self.clock(),
                max_age_s=math.inf,
            )
        except SignatureError:
            return None

    async def _read_earlier_bind(self, ref: PodRef, node: str) -> Assignment | None:
        assert self.api is not None
        try:
            pod = await self.api.get_pod(ref.namespace, ref.name)
        except Exception:
            return None
        if str((pod.get("metadata") or {}).get("uid", "")) != ref.uid:
            return None
        return self._earlier_bind(pod, node)

    async def _event(self, ref: PodRef, reason: str, message: str) -> None:
        assert self.api is not None
        try:
            await self.api.event(ref, reason, message)
        except Exception as exc:  # an event is a courtesy; the bind stands
            log.debug("could not record an event", pod=str(ref), error=str(exc))

    async def settled(self) -> None:
        """Wait for events still being posted (tests)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
