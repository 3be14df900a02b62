"""Delegated authentication and authorization, as Kubernetes components (kubelet, kube-scheduler,
kube-rbac-proxy) guard their own HTTP endpoints: the API server says who a bearer token belongs to
(TokenReview) and whether that user may ``get`` the path (SubjectAccessReview on a non-resource URL, the
same rule that grants ``/metrics`` to Prometheus). Decisions are cached briefly, keyed by a hash of the token,
in a bounded table; at most a few reviews run at once, so a flood of made-up tokens costs the API server
little. Used by the node daemon's /status (and /metrics on request).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kxpu.logs import error_text, get_logger

if TYPE_CHECKING:
    from lightkube import AsyncClient

log = get_logger("kxpu.kube.review")

ALLOWED_TTL_SECONDS = 10.0  # how long a token keeps a decision: a revoked binding takes effect within it
DENIED_TTL_SECONDS = 10.0
CACHE_ENTRIES = 1024
CONCURRENT_REVIEWS = 4
# A review not answered in this time is a 503: a client (`kxpu status` waits 10 s) hears why rather than
# timing out, and a stuck API connection does not hold the request's slot.
REVIEW_SECONDS = 5.0
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def api_access_problem() -> str:
    """Why this process could not reach the API server with its own credentials ("" when it has some), as
    lightkube's KubeConfig.from_env looks for them, without importing lightkube (~4 MiB on every node
    before anyone asks for /status): the pod's service account, else $KUBECONFIG or ~/.kube/config."""
    if Path(SERVICE_ACCOUNT_DIR, "token").is_file():
        return ""
    kubeconfig = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(
        Path.home() / ".kube" / "config"
    )
    if Path(kubeconfig).expanduser().is_file():
        return ""
    return f"no service-account token in {SERVICE_ACCOUNT_DIR} and no kubeconfig at {kubeconfig}"


class ReviewAuthorizer:
    """``await authorizer(token, path, verb)`` → (HTTP status, reason): 200, 401, 403, or 503 when the API
    server could not be asked (never cached: the next request asks again)."""

    def __init__(
        self,
        client: Callable[[], AsyncClient] | None,
        no_client_reason: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client_factory = client
        self._client: AsyncClient | None = None
        self.problem = "" if client is not None else no_client_reason  # logged by the server once listening
        self._clock = clock
        self._cache: dict[tuple[str, str, str], tuple[float, tuple[int, str]]] = {}
        self._reviews = asyncio.Semaphore(CONCURRENT_REVIEWS)
        self._failing = False
        self.reviews = 0  # TokenReviews sent (the cache saves the rest)

    async def __call__(self, token: str | None, path: str, verb: str) -> tuple[int, str]:
        if not token:
            return 401, "a bearer token is needed (Authorization: Bearer <token>); `kxpu status` sends one"
        key = (hashlib.sha256(token.encode()).hexdigest(), path, verb)
        cached = self._cache.get(key)
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        async with self._reviews:
            decision = await self._review(token, path, verb)
        if decision[0] != 503:
            self._remember(key, decision)
        return decision

    def _remember(self, key: tuple[str, str, str], decision: tuple[int, str]) -> None:
        now = self._clock()
        if len(self._cache) >= CACHE_ENTRIES:
            for stale in [k for k, (expires, _) in self._cache.items() if expires <= now]:
                del self._cache[stale]
            while len(self._cache) >= CACHE_ENTRIES:  # the oldest first (insertion order)
                del self._cache[next(iter(self._cache))]
        ttl = ALLOWED_TTL_SECONDS if decision[0] == 200 else DENIED_TTL_SECONDS
        self._cache[key] = (now + ttl, decision)

    async def _review(self, token: str, path: str, verb: str) -> tuple[int, str]:
        if self._client_factory is None:
            return 503, self.problem or "this daemon has no API access to review tokens"
        try:
            if self._client is None:
                # lightkube is loaded on the first review, off the event loop (a few hundred ms on a busy node)
                await asyncio.to_thread(importlib.import_module, "lightkube.resources.authorization_v1")
                await asyncio.to_thread(importlib.import_module, "lightkube.resources.authentication_v1")
                self._client = self._client_factory()
            self.reviews += 1
            async with asyncio.timeout(REVIEW_SECONDS):
                decision = await self._ask(self._client, token, path, verb)
        except TimeoutError:
            return self._failed(f"the API server did not answer within {REVIEW_SECONDS:g} s")
        except Exception as exc:  # the API server's refusal or the connection's failure
            return self._failed(error_text(exc))
        if self._failing:
            log.info("token reviews work again")
            self._failing = False
        return decision

    def _failed(self, reason: str) -> tuple[int, str]:
        if not self._failing:  # said once until reviews work again
            log.warning("cannot review a token with the API server; answering 503", error=reason)
            self._failing = True
        return 503, f"cannot review the token with the API server: {reason}"

    @staticmethod
    async def _ask(client: AsyncClient, token: str, path: str, verb: str) -> tuple[int, str]:
        from lightkube.models.authentication_v1 import TokenReviewSpec
        from lightkube.models.authorization_v1 import NonResourceAttributes, SubjectAccessReviewSpec
        from lightkube.resources.authentication_v1 import TokenReview
        from lightkube.resources.authorization_v1 import SubjectAccessReview

        review = await client.create(TokenReview(spec=TokenReviewSpec(token=token)))
        status = review.status
        if status is None or not status.authenticated or status.user is None:
            reason = (status.error if status is not None else None) or "the token is not valid"
            return 401, f"not authenticated: {reason}"
        user = status.user
        access = await client.create(
            SubjectAccessReview(
                spec=SubjectAccessReviewSpec(
                    user=user.username,
                    uid=user.uid,
                    groups=user.groups,
                    extra=user.extra,
                    nonResourceAttributes=NonResourceAttributes(path=path, verb=verb),
                )
            )
        )
        if access.status is not None and access.status.allowed and not access.status.denied:
            return 200, ""
        why = access.status.reason if access.status is not None and access.status.reason else ""
        return 403, f'user "{user.username}" may not {verb} {path}' + (f": {why}" if why else "")
