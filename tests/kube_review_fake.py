"""A stand-in for the two API server endpoints delegated authentication uses, over real HTTP, with the API
server's request and response shapes (authentication.k8s.io/v1 TokenReview, authorization.k8s.io/v1
SubjectAccessReview, and its v1 Status for refusals): the caller itself must present a known token and be
allowed to create reviews, as RBAC would require."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class User:
    name: str
    uid: str = "uid-1"
    groups: tuple[str, ...] = ("system:authenticated",)


@dataclass
class FakeReviewApi:
    tokens: dict[str, User] = field(default_factory=dict)
    # (user name, non-resource path, verb) allowed, as a ClusterRole with nonResourceURLs would
    allowed: set[tuple[str, str, str]] = field(default_factory=set)
    reviewers: set[str] = field(default_factory=set)  # users allowed to create token and access reviews
    token_reviews: int = 0
    access_reviews: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", self._token_review)
        app.router.add_post("/apis/authorization.k8s.io/v1/subjectaccessreviews", self._access_review)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, token: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
            "current-context": "fake",
        }

    def _caller(self, request: web.Request, resource: str, group: str) -> web.Response | None:
        auth = request.headers.get("Authorization", "")
        user = self.tokens.get(auth.removeprefix("Bearer ")) if auth.startswith("Bearer ") else None
        if user is None:
            return _status(401, "Unauthorized", "Unauthorized")
        if user.name not in self.reviewers:
            return _status(
                403,
                "Forbidden",
                f'{resource}.{group} is forbidden: User "{user.name}" cannot create resource "{resource}" in '
                f'API group "{group}" at the cluster scope',
            )
        return None

    async def _token_review(self, request: web.Request) -> web.Response:
        refused = self._caller(request, "tokenreviews", "authentication.k8s.io")
        if refused is not None:
            return refused
        body = await request.json()
        assert body["apiVersion"] == "authentication.k8s.io/v1" and body["kind"] == "TokenReview", body
        self.token_reviews += 1
        user = self.tokens.get(body["spec"]["token"])
        if user is None:
            status: dict[str, Any] = {"user": {}, "error": "[invalid bearer token, token lookup failed]"}
        else:
            status = {
                "authenticated": True,
                "user": {"username": user.name, "uid": user.uid, "groups": list(user.groups)},
                "audiences": ["https://kubernetes.default.svc.cluster.local"],
            }
        return _json(
            {
                "kind": "TokenReview",
                "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"creationTimestamp": None},
                "spec": body["spec"],
                "status": status,
            },
            201,
        )

    async def _access_review(self, request: web.Request) -> web.Response:
        refused = self._caller(request, "subjectaccessreviews", "authorization.k8s.io")
        if refused is not None:
            return refused
        body = await request.json()
        assert body["apiVersion"] == "authorization.k8s.io/v1" and body["kind"] == "SubjectAccessReview", body
        spec = body["spec"]
        self.access_reviews.append(spec)
        attributes = spec["nonResourceAttributes"]
        allowed = (spec["user"], attributes["path"], attributes["verb"]) in self.allowed
        status: dict[str, Any] = {"allowed": allowed}
        if allowed:
            status["reason"] = 'RBAC: allowed by ClusterRoleBinding "readers" of ClusterRole "reader"'
        return _json(
            {
                "kind": "SubjectAccessReview",
                "apiVersion": "authorization.k8s.io/v1",
                "metadata": {"creationTimestamp": None},
                "spec": spec,
                "status": status,
            },
            201,
        )


def _status(code: int, reason: str, message: str) -> web.Response:
    return _json(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
        code,
    )


def _json(doc: dict[str, Any], status: int) -> web.Response:
    """As the API server answers: exactly ``application/json`` (clients such as lightkube match it exactly)."""
    return web.Response(
        body=json.dumps(doc).encode(), status=status, headers={"Content-Type": "application/json"}
    )
