"""The webhook's one API call on the DRA path: make sure the ResourceClaimTemplates a converted pod names exist.

Templates are named after a hash of their spec (``kxpu.sharing.claims``), so one that exists already is the same
one (a 409 is success), unless someone else made an object of that name with another spec: refused, naming it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kxpu.logs import error_text, get_logger
from kxpu.sharing.claims import Template

if TYPE_CHECKING:
    from lightkube import AsyncClient

log = get_logger("kxpu.kube.sharing.templates")

_lk: Any = None
_loading = threading.Lock()


def _load() -> Any:
    global _lk
    with _loading:
        if _lk is None:
            from lightkube import ApiError
            from lightkube.generic_resource import GenericNamespacedResource, create_api_info

            class ClaimTemplate(GenericNamespacedResource):
                _api_info = create_api_info(
                    "resource.k8s.io", "v1", "ResourceClaimTemplate", "resourceclaimtemplates"
                )

            _lk = (ApiError, ClaimTemplate)
        return _lk


def _holds(stored: Any, wanted: Any) -> bool:
    """Whether the API server's copy has every field kxpu wrote, with its value (it may add defaults)."""
    if isinstance(wanted, dict):
        return isinstance(stored, dict) and all(_holds(stored.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(stored, list) and len(stored) == len(wanted) and all(map(_holds, stored, wanted))
    return bool(stored == wanted)


def same_template(stored: Mapping[str, Any], wanted: Any) -> bool:
    """Whether a template found under kxpu's name is exactly kxpu's, both ways: one made by someone else under
    the predictable name with something more (opaque config with env, tolerations, admin access, labels for
    its claims) would otherwise reach every pod converted to it."""
    spec = stored.get("spec")
    return not stored.get("metadata") and _holds(spec, wanted) and _holds(wanted, spec)


class TemplateError(Exception):
    """A template could not be made: one line, naming it and why."""


class TemplateStore:
    """Creates templates through the API server (the webhook's service account: ``create``, ``get``)."""

    def __init__(self, client: AsyncClient | None = None) -> None:
        self._client = client

    def _api(self) -> AsyncClient:
        if self._client is None:
            from kxpu.kube.client import make_client

            self._client = make_client()
        return self._client

    async def ensure(self, templates: Sequence[Template]) -> None:
        api_error, kind = _load()
        client = self._api()
        for template in templates:
            where = f"ResourceClaimTemplate {template.namespace}/{template.name}"
            try:
                await client.create(kind.from_dict(template.manifest()))
                log.info("created a claim template", template=f"{template.namespace}/{template.name}")
                continue
            except api_error as exc:
                if exc.status.code != 409:
                    raise TemplateError(f"cannot create {where}: {exc.status.message}") from None
            except (
                Exception
            ) as exc:  # a broken connection, a timeout: the pod is refused, its creator retries
                raise TemplateError(f"cannot create {where}: {error_text(exc)}") from None
            try:
                existing = await client.get(kind, template.name, namespace=template.namespace)
            except Exception as exc:
                raise TemplateError(f"cannot read {where}: {error_text(exc)}") from None
            if not same_template(existing.get("spec") or {}, template.spec):
                raise TemplateError(
                    f"{where} exists with another spec (kxpu names its templates after their spec): delete it"
                )
