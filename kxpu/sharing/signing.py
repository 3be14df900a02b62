"""Signed assignments: the scheduler's decision, written on the pod, that the node can trust.

The extender writes two pod annotations at bind:

- ``kxpu.io/assignment``: the assignment as canonical JSON (sorted keys, no spaces, ASCII);
- ``kxpu.io/assignment-signature``: ``v1.<key id>.<base64url HMAC-SHA256>``.

The MAC covers a domain tag and the canonical encoding of pod UID, namespace, name, node,
issued-at and every container's grants, so a pod cannot bring its own assignment (no key),
reuse another pod's (different UID), or move one to another node. The node recomputes the
encoding from the *parsed* assignment and compares MACs in constant time.

Key rotation: a list of keys, each at least 32 bytes; the first signs, all verify. The key
id (first 8 hex digits of SHA-256 of the key) only picks which key to try; it reveals
nothing useful about the key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

from kxpu.sharing.model import Assignment, ContainerAssignment, DeviceGrant

ASSIGNMENT_ANNOTATION = "kxpu.io/assignment"
SIGNATURE_ANNOTATION = "kxpu.io/assignment-signature"
SIGNATURE_VERSION = "v1"
MIN_KEY_BYTES = 32
_DOMAIN = b"kxpu-assignment-v1\n"


class SignatureError(ValueError):
    """An assignment that must not be trusted; the message says why (never which key bytes)."""


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    if not keys:
        raise ValueError("no signing keys")
    for n, key in enumerate(keys):
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"signing key {n} is {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
    return list(keys)


def parse_keys(text: str | bytes) -> list[bytes]:
    """Keys from a Secret entry or file: one per line, first signs; blank lines and ``#`` lines skipped."""
    raw = text.encode() if isinstance(text, str) else text
    keys = [line.strip() for line in raw.splitlines()]
    return check_keys([k for k in keys if k and not k.startswith(b"#")])


def key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:8]


def _doc(a: Assignment) -> dict[str, Any]:
    return {
        "uid": a.pod_uid,
        "namespace": a.namespace,
        "name": a.name,
        "node": a.node,
        "issuedAt": a.issued_at,
        "containers": [
            {
                "name": c.container,
                "resource": c.resource,
                "devices": [
                    {"id": g.device, "uuid": g.uuid, "memoryMiB": g.memory_mib, "cores": g.cores}
                    for g in c.devices
                ],
            }
            for c in a.containers
        ],
    }


def encode_assignment(assignment: Assignment) -> str:
    """The canonical encoding: both the annotation's value and (after the domain tag) what is MACed."""
    return json.dumps(_doc(assignment), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _expect(doc: dict[str, Any], keys: dict[str, type], where: str) -> None:
    if set(doc) != set(keys):
        raise SignatureError(f"{where}: expected keys {', '.join(sorted(keys))}")
    for key, kind in keys.items():
        value = doc[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise SignatureError(f"{where}.{key}: expected {kind.__name__}")


def decode_assignment(text: str) -> Assignment:
    """Parse an assignment annotation strictly (it is untrusted until verified)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise SignatureError("assignment is not JSON") from None
    if not isinstance(doc, dict):
        raise SignatureError("assignment is not a JSON object")
    _expect(
        doc,
        {"uid": str, "namespace": str, "name": str, "node": str, "issuedAt": int, "containers": list},
        "assignment",
    )
    containers = []
    for n, item in enumerate(doc["containers"]):
        where = f"assignment.containers[{n}]"
        if not isinstance(item, dict):
            raise SignatureError(f"{where}: expected an object")
        _expect(item, {"name": str, "resource": str, "devices": list}, where)
        grants = []
        for m, grant in enumerate(item["devices"]):
            if not isinstance(grant, dict):
                raise SignatureError(f"{where}.devices[{m}]: expected an object")
            _expect(grant, {"id": str, "uuid": str, "memoryMiB": int, "cores": int}, f"{where}.devices[{m}]")
            grants.append(DeviceGrant(grant["id"], grant["uuid"], grant["memoryMiB"], grant["cores"]))
        containers.append(ContainerAssignment(item["name"], item["resource"], tuple(grants)))
    return Assignment(
        doc["uid"], doc["namespace"], doc["name"], doc["node"], tuple(containers), doc["issuedAt"]
    )


def _mac(key: bytes, assignment: Assignment) -> bytes:
    return hmac.new(key, _DOMAIN + encode_assignment(assignment).encode(), hashlib.sha256).digest()


def sign(assignment: Assignment, keys: Sequence[bytes]) -> str:
    """The signature annotation's value, made with the first key."""
    key = check_keys(keys)[0]
    digest = base64.urlsafe_b64encode(_mac(key, assignment)).rstrip(b"=").decode()
    return f"{SIGNATURE_VERSION}.{key_id(key)}.{digest}"


def verify(
    assignment_text: str | None,
    signature: str | None,
    keys: Sequence[bytes],
    *,
    pod_uid: str,
    namespace: str,
    name: str,
    node: str,
    now: float,
    max_age_s: float,
    max_skew_s: float = 60.0,
) -> Assignment:
    """The assignment, if it is signed by one of ``keys`` for exactly this pod and node and recent.

    ``pod_uid``/``namespace``/``name`` must come from the pod object itself (the API
    server's metadata), never from the annotation.
    """
    if not assignment_text:
        raise SignatureError(f"pod has no {ASSIGNMENT_ANNOTATION} annotation (not scheduled by kxpu?)")
    if not signature:
        raise SignatureError(f"pod has no {SIGNATURE_ANNOTATION} annotation")
    assignment = decode_assignment(assignment_text)
    parts = signature.split(".")
    if len(parts) != 3 or parts[0] != SIGNATURE_VERSION:
        raise SignatureError(f"signature is not in the {SIGNATURE_VERSION}.<key id>.<mac> form")
    _, wanted_id, mac_text = parts
    try:
        mac = base64.urlsafe_b64decode(mac_text + "=" * (-len(mac_text) % 4))
    except (ValueError, TypeError):
        raise SignatureError("signature MAC is not base64url") from None
    candidates = [k for k in check_keys(keys) if key_id(k) == wanted_id]
    if not candidates:
        raise SignatureError(f"signed with unknown key {wanted_id} (rotated out, or forged)")
    if not any(hmac.compare_digest(_mac(k, assignment), mac) for k in candidates):
        raise SignatureError("signature does not match the assignment (forged or altered)")
    if assignment.pod_uid != pod_uid:
        raise SignatureError(f"assignment is for pod UID {assignment.pod_uid}, not {pod_uid}")
    if (assignment.namespace, assignment.name) != (namespace, name):
        raise SignatureError(
            f"assignment is for pod {assignment.namespace}/{assignment.name}, not {namespace}/{name}"
        )
    if assignment.node != node:
        raise SignatureError(f"assignment is for node {assignment.node!r}, not {node!r}")
    age = now - assignment.issued_at
    if age > max_age_s:
        raise SignatureError(f"assignment is stale: issued {age:.0f}s ago (limit {max_age_s:.0f}s)")
    if age < -max_skew_s:
        raise SignatureError(f"assignment is issued {-age:.0f}s in the future (clock skew?)")
    return assignment
