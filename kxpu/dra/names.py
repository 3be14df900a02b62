"""Names DRA needs that kxpu's model does not have: device names, CDI names for claims (driver names are
the ``dra:`` section's, in ``config.py``).

The API's rules (``k8s.io/api/resource/v1``, validated by the API server): a driver name is a
lowercase DNS subdomain of at most 63 characters; a device name is a DNS label (at most 63
lowercase letters, digits and ``-``); a pool name is DNS subdomains joined by ``/``. kxpu device
IDs are looser (``GPU-4f3c…``, ``0000:19:00.0``, ``Ascend910-0``, ``dri_renderD128``), so each is
mapped to a device name that is the ID itself when the ID already is a label, and otherwise a
lowercased, cleaned form with a short hash of the ID appended: deterministic (the same ID always
gets the same name, across restarts and nodes) and collision-free in practice.
"""

from __future__ import annotations

import hashlib
import re

DEVICE_NAME_MAX = 63
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_HASH_LEN = 8
# The CDI class of the per-claim devices kxpu writes: "<driver name>/claim=<claim UID>-<request>".
CLAIM_CDI_CLASS = "claim"


def is_dns_label(value: str) -> bool:
    return len(value) <= DEVICE_NAME_MAX and bool(_DNS_LABEL.match(value))


def device_name(device_id: str) -> str:
    """The DRA device name of a kxpu device ID (see the module docstring)."""
    if is_dns_label(device_id):
        return device_id
    digest = hashlib.sha256(device_id.encode()).hexdigest()[:_HASH_LEN]
    base = _NOT_LABEL.sub("-", device_id.lower()).strip("-")
    base = base[: DEVICE_NAME_MAX - _HASH_LEN - 1].strip("-")
    return f"{base}-{digest}" if base else f"d-{digest}"


def claim_cdi_kind(driver: str) -> str:
    return f"{driver}/{CLAIM_CDI_CLASS}"


def claim_cdi_device(claim_uid: str, request: str) -> str:
    """The CDI device name of one request of one claim: unique per claim UID, so never reused (runtimes
    may cache specs)."""
    return f"{claim_uid}-{request}"


def parent_request(request: str) -> str:
    """``gpu/a100`` (a subrequest chosen from ``firstAvailable``) → ``gpu``: containers name the parent."""
    return request.split("/", 1)[0]
