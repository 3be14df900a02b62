"""Names DRA needs that kxpu's model does not have: driver names, device names, CDI names for claims.

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

DRIVER_NAME_MAX = 63
DEVICE_NAME_MAX = 63
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_HASH_LEN = 8
# The CDI class of the per-claim devices kxpu writes: "<driver name>/claim=<claim UID>-<request>".
CLAIM_CDI_CLASS = "claim"


def is_dns_label(value: str) -> bool:
    return len(value) <= DEVICE_NAME_MAX and bool(_DNS_LABEL.match(value))


def check_driver_name(name: str) -> str:
    """The API server's rule for ``spec.driver`` (and the kubelet's plugin name)."""
    if len(name) > DRIVER_NAME_MAX or not _DNS_SUBDOMAIN.match(name):
        raise ValueError(
            f"DRA driver name {name!r} must be a lowercase DNS subdomain of at most {DRIVER_NAME_MAX} "
            "characters, ending in a domain the vendor owns (e.g. npu.example.com)"
        )
    return name


def default_driver_name(resource: str) -> str:
    """``example.com/npu`` → ``npu.example.com``, ``nvidia.com/gpu`` → ``gpu.nvidia.com`` (NVIDIA's own
    DRA driver name): the resource's name part becomes the first DNS label of its domain."""
    domain, _, short = resource.partition("/")
    label = _NOT_LABEL.sub("-", short.lower()).strip("-")
    name = f"{label}.{domain}" if label else domain
    try:
        return check_driver_name(name)
    except ValueError:
        raise ValueError(
            f"no DRA driver name can be derived from {resource!r} ({name!r} is not a DNS subdomain of at most "
            f"{DRIVER_NAME_MAX} characters): set dra.driverName"
        ) from None


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
