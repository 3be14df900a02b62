"""Signed assignments: the scheduler's decision, written on the pod, that the node can trust.

The extender writes two pod annotations at bind:

- ``kxpu.io/assignment``: the assignment as canonical JSON (sorted keys, no spaces, ASCII);
- ``kxpu.io/assignment-signature``: ``v2.<key id>.<base64url Ed25519 signature>``, or, with the
  older shared key, ``v1.<key id>.<base64url HMAC-SHA256>``.

The signature covers a domain tag and the canonical encoding of pod UID, namespace, name,
node, issued-at and every container's grants, so a pod cannot bring its own assignment (no
key), reuse another pod's (different UID), or move one to another node. The node recomputes
the encoding from the *parsed* assignment and checks the signature (``cryptography``'s
Ed25519; HMACs compared in constant time).

Ed25519 (v2): only the extender holds the private key; nodes hold public keys, so root on a
node can verify but never mint an assignment. HMAC (v1): every verifier could sign too; kept
for the upgrade from it (accept both, then HMAC off: docs/sharing.md).

Keys (``parse_keyring``): a text of entries in order, PEM blocks (``PRIVATE KEY``: an Ed25519
private key, PKCS#8; ``PUBLIC KEY``: an Ed25519 public key) and, outside PEM blocks, one HMAC key
per line (at least 32 bytes; ``#`` lines and blank lines skipped). The first entry that can
sign signs; every entry verifies (a private key by its public key). The key id (first 8 hex
digits of SHA-256 of the HMAC key or of the raw public key) picks which key to try, so several
keys are accepted at once during a rotation; it reveals nothing useful about a key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_pem_private_key,
    load_pem_public_key,
)

from kxpu.sharing.model import Assignment, ContainerAssignment, DeviceGrant

ASSIGNMENT_ANNOTATION = "kxpu.io/assignment"
SIGNATURE_ANNOTATION = "kxpu.io/assignment-signature"
SIGNATURE_VERSION = "v1"  # HMAC-SHA256 with a shared key
ED25519_VERSION = "v2"  # Ed25519
MIN_KEY_BYTES = 32
_DOMAIN = b"kxpu-assignment-v1\n"
_DOMAIN_V2 = b"kxpu-assignment-v2\n"
_PEM = re.compile(rb"-----BEGIN ([A-Z ]+)-----.*?-----END \1-----", re.DOTALL)


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


def public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def public_key_id(key: Ed25519PublicKey) -> str:
    return key_id(public_bytes(key))


def public_pem(key: Ed25519PublicKey) -> str:
    return key.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()


def generate_private_pem() -> str:
    """A new Ed25519 private key, PKCS#8 PEM (what ``openssl genpkey -algorithm ed25519`` writes)."""
    return (
        Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
    )


@dataclass(frozen=True)
class Keyring:
    """Who signs (the first entry that can) and every key that verifies, by key id."""

    signer: Ed25519PrivateKey | bytes | None = None
    hmac_keys: dict[str, bytes] = field(default_factory=dict)
    public_keys: dict[str, Ed25519PublicKey] = field(default_factory=dict)

    @classmethod
    def hmac_only(cls, keys: Sequence[bytes]) -> Keyring:
        keys = check_keys(keys)
        return cls(keys[0], {key_id(k): k for k in keys}, {})

    def __bool__(self) -> bool:
        return bool(self.hmac_keys or self.public_keys)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Keyring):
            return NotImplemented
        return self.describe() == other.describe() and self.hmac_keys == other.hmac_keys

    def __hash__(self) -> int:
        return hash(self.describe())

    @property
    def signer_id(self) -> str | None:
        if isinstance(self.signer, bytes):
            return f"{SIGNATURE_VERSION}.{key_id(self.signer)}"
        if self.signer is not None:
            return f"{ED25519_VERSION}.{public_key_id(self.signer.public_key())}"
        return None

    def describe(self) -> str:
        """Which key signs and which verify, by id only (for logs)."""
        verify = [f"{SIGNATURE_VERSION}.{i}" for i in self.hmac_keys] + [
            f"{ED25519_VERSION}.{i}" for i in self.public_keys
        ]
        return f"signs: {self.signer_id or 'none'}; verifies: {', '.join(verify) or 'none'}"

    def public_pems(self) -> str:
        """Every Ed25519 key that verifies, as public PEM blocks (what nodes need; never a secret)."""
        return "".join(public_pem(k) for k in self.public_keys.values())

    def __add__(self, other: Keyring) -> Keyring:
        return Keyring(
            self.signer if self.signer is not None else other.signer,
            {**other.hmac_keys, **self.hmac_keys},
            {**other.public_keys, **self.public_keys},
        )


Keys = Keyring | Sequence[bytes]


def as_keyring(keys: Keys) -> Keyring:
    return keys if isinstance(keys, Keyring) else Keyring.hmac_only(keys)


def parse_keyring(
    text: str | bytes, *, private_ok: bool = True, where: str = "keys", hmac_ok: bool = True
) -> Keyring:
    """Keys from a Secret entry, ConfigMap entry or file (module docstring): PEM blocks and HMAC lines.

    ``private_ok=False`` (the node side) refuses a private key: nodes verify with public keys only.
    ``hmac_ok=False`` refuses HMAC lines: a source must be named as holding HMAC keys (``hmac: true``).
    Errors name ``where`` and the entry, never key bytes.
    """
    raw = text.encode() if isinstance(text, str) else text
    signer: Ed25519PrivateKey | bytes | None = None
    hmac_keys: dict[str, bytes] = {}
    public: dict[str, Ed25519PublicKey] = {}
    entries: list[tuple[int, bytes, bytes | None]] = []  # (offset, block or line, PEM label)
    last = 0
    for match in _PEM.finditer(raw):
        entries += [(last + i, ln, None) for i, ln in _lines(raw[last : match.start()])]
        entries.append((match.start(), match.group(0), match.group(1)))
        last = match.end()
    entries += [(last + i, ln, None) for i, ln in _lines(raw[last:])]
    if b"-----BEGIN" in b"".join(e[1] for e in entries if e[2] is None):
        raise ValueError(f"{where}: a PEM block has no matching END line")
    for n, (_, entry, label) in enumerate(sorted(entries, key=lambda e: e[0])):
        if label is None:
            if not hmac_ok:
                raise ValueError(
                    f"{where}: entry {n} is an HMAC key, but this source is not marked hmac: true "
                    "(an HMAC key lets every holder sign; name it only for the upgrade from HMAC)"
                )
            if len(entry) < MIN_KEY_BYTES:
                raise ValueError(
                    f"{where}: entry {n} (an HMAC key) is {len(entry)} bytes; at least {MIN_KEY_BYTES} are needed"
                )
            hmac_keys.setdefault(key_id(entry), entry)
            if signer is None:
                signer = entry
        elif label == b"PRIVATE KEY":
            if not private_ok:
                raise ValueError(
                    f"{where}: entry {n} is a private key; nodes verify with public keys only "
                    "(give them `openssl pkey -pubout` of it)"
                )
            key = _load(load_pem_private_key, entry, where, n)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"{where}: entry {n} is a {type(key).__name__}, not an Ed25519 private key")
            public.setdefault(public_key_id(key.public_key()), key.public_key())
            if signer is None:
                signer = key
        elif label == b"PUBLIC KEY":
            pub = _load(load_pem_public_key, entry, where, n)
            if not isinstance(pub, Ed25519PublicKey):
                raise ValueError(f"{where}: entry {n} is a {type(pub).__name__}, not an Ed25519 public key")
            public.setdefault(public_key_id(pub), pub)
        else:
            raise ValueError(
                f"{where}: entry {n} is a PEM {label.decode(errors='replace')!r} block; "
                "expected PRIVATE KEY or PUBLIC KEY (Ed25519)"
            )
    if not hmac_keys and not public:
        raise ValueError(f"{where}: no keys")
    return Keyring(signer, hmac_keys, public)


def _lines(chunk: bytes) -> list[tuple[int, bytes]]:
    out = []
    offset = 0
    for line in chunk.splitlines(keepends=True):
        stripped = line.strip()
        if stripped and not stripped.startswith(b"#"):
            out.append((offset, stripped))
        offset += len(line)
    return out


def _load(loader: Any, pem: bytes, where: str, n: int) -> Any:
    try:
        if loader is load_pem_private_key:
            return load_pem_private_key(pem, password=None)
        return loader(pem)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{where}: entry {n} is not a readable PEM key ({first})") from None


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


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def sign(assignment: Assignment, keys: Keys) -> str:
    """The signature annotation's value, made with the keyring's signer (the first key that can sign)."""
    ring = as_keyring(keys)
    signer = ring.signer
    if signer is None:
        raise SignatureError("no signing key: these keys can only verify (public keys)")
    if isinstance(signer, bytes):
        return f"{SIGNATURE_VERSION}.{key_id(signer)}.{_b64(_mac(signer, assignment))}"
    signature = signer.sign(_DOMAIN_V2 + encode_assignment(assignment).encode())
    return f"{ED25519_VERSION}.{public_key_id(signer.public_key())}.{_b64(signature)}"


def verify(
    assignment_text: str | None,
    signature: str | None,
    keys: Keys,
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
    check_signature(assignment, signature, keys)
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


def is_unknown_key(exc: SignatureError) -> bool:
    """Whether the refusal was for a key not held here (worth reading the keys again: a rotation)."""
    text = str(exc)
    return "unknown" in text or "no Ed25519 public key is configured" in text


def check_signature(assignment: Assignment, signature: str, keys: Keys) -> None:
    """Raise SignatureError unless ``signature`` is one of ``keys``' over ``assignment``; the message says why."""
    ring = as_keyring(keys)
    parts = signature.split(".")
    if len(parts) != 3 or parts[0] not in (SIGNATURE_VERSION, ED25519_VERSION):
        raise SignatureError(
            f"signature is not in the {ED25519_VERSION}.<key id>.<signature> "
            f"(or {SIGNATURE_VERSION}.<key id>.<mac>) form"
        )
    version, wanted_id, digest_text = parts
    shown_id = wanted_id[:16].encode("ascii", "backslashreplace").decode()
    try:
        digest = base64.b64decode(digest_text + "=" * (-len(digest_text) % 4), altchars=b"-_", validate=True)
    except (ValueError, TypeError):
        raise SignatureError("signature is not base64url") from None
    if version == SIGNATURE_VERSION:
        if not ring.hmac_keys:
            raise SignatureError(
                f"signed with HMAC key {shown_id}, but HMAC signatures are no longer accepted here "
                "(Ed25519 keys only)"
            )
        key = ring.hmac_keys.get(wanted_id)
        if key is None:
            raise SignatureError(f"signed with unknown HMAC key {shown_id} (rotated out, or forged)")
        if not hmac.compare_digest(_mac(key, assignment), digest):
            raise SignatureError("signature does not match the assignment (forged or altered)")
        return
    public = ring.public_keys.get(wanted_id)
    if public is None:
        if not ring.public_keys:
            raise SignatureError(
                f"signed with Ed25519 key {shown_id}, but no Ed25519 public key is configured here"
            )
        raise SignatureError(f"signed with unknown Ed25519 key {shown_id} (rotated out, or forged)")
    try:
        public.verify(digest, _DOMAIN_V2 + encode_assignment(assignment).encode())
    except InvalidSignature:
        raise SignatureError("signature does not match the assignment (forged or altered)") from None
