"""Ed25519 assignments: the extender signs, nodes verify with public keys only; rotation by key id; the
upgrade from HMAC (accept both, then HMAC off); garbage keys and signatures get one-line errors."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from kxpu.kube.sharing.keys import KeyStore
from kxpu.sharing import signing
from kxpu.sharing.config import KeySource, SharingConfig
from kxpu.sharing.model import Assignment, ContainerAssignment, DeviceGrant

ASSIGNMENT = Assignment(
    "uid-1",
    "ns",
    "p",
    "node-a",
    (ContainerAssignment("c0", "nvidia.com/gpu", (DeviceGrant("gpu-0", "GPU-0", 3000, 30),)),),
    1_000_000,
)
TEXT = signing.encode_assignment(ASSIGNMENT)
PRIVATE = signing.generate_private_pem()
PRIVATE_NEW = signing.generate_private_pem()
HMAC = b"h" * 32
SCHEDULER = signing.parse_keyring(PRIVATE)
NODE = signing.parse_keyring(SCHEDULER.public_pems(), private_ok=False)


def _verify(signature: str, keys: signing.Keys, text: str = TEXT, **kw: Any) -> Assignment:
    args: dict[str, Any] = dict(
        pod_uid="uid-1", namespace="ns", name="p", node="node-a", now=1_000_010, max_age_s=600
    )
    args.update(kw)
    return signing.verify(text, signature, keys, **args)


def test_the_extender_signs_and_a_node_with_only_the_public_key_verifies() -> None:
    sig = signing.sign(ASSIGNMENT, SCHEDULER)
    assert sig.startswith(f"v2.{next(iter(SCHEDULER.public_keys))}.")
    assert _verify(sig, NODE) == ASSIGNMENT
    assert NODE.signer is None  # a node cannot mint an assignment
    with pytest.raises(signing.SignatureError, match="no signing key"):
        signing.sign(ASSIGNMENT, NODE)
    with pytest.raises(signing.SignatureError, match="pod UID"):
        _verify(sig, NODE, pod_uid="uid-2")
    with pytest.raises(signing.SignatureError, match="node"):
        _verify(sig, NODE, node="node-b")


def test_a_node_refuses_key_material_holding_a_private_key() -> None:
    with pytest.raises(ValueError, match="entry 0 is a private key; nodes verify with public keys only"):
        signing.parse_keyring(PRIVATE, private_ok=False, where="configmap kxpu-system/keys")


def test_openssl_keys_are_read_too(tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    try:
        subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", key], check=True)
        pub = subprocess.run(
            ["openssl", "pkey", "-in", key, "-pubout"], check=True, capture_output=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no openssl with Ed25519")
    ring = signing.parse_keyring(key.read_bytes())
    assert _verify(signing.sign(ASSIGNMENT, ring), signing.parse_keyring(pub, private_ok=False)) == ASSIGNMENT


def test_rotation_accepts_every_published_key_and_the_first_signs() -> None:
    # step 1: the new key verifies (published), the old one still signs
    step1 = signing.parse_keyring(PRIVATE + PRIVATE_NEW)
    node = signing.parse_keyring(step1.public_pems(), private_ok=False)
    old_sig = signing.sign(ASSIGNMENT, step1)
    assert old_sig.split(".")[1] == step1.signer_id.split(".")[1]  # type: ignore[union-attr]
    # step 2: the new key signs; assignments signed with the old one still verify
    step2 = signing.parse_keyring(PRIVATE_NEW + PRIVATE)
    new_sig = signing.sign(ASSIGNMENT, step2)
    assert new_sig.split(".")[1] != old_sig.split(".")[1]
    assert _verify(old_sig, node) == ASSIGNMENT
    assert _verify(new_sig, node) == ASSIGNMENT
    # step 3: the old key is gone: its assignments are refused, naming the key id
    node3 = signing.parse_keyring(signing.parse_keyring(PRIVATE_NEW).public_pems(), private_ok=False)
    old_id = old_sig.split(".")[1]
    with pytest.raises(
        signing.SignatureError, match=f"unknown Ed25519 key {old_id} \\(rotated out, or forged\\)"
    ):
        _verify(old_sig, node3)
    assert _verify(new_sig, node3) == ASSIGNMENT


def test_upgrade_from_hmac_accepts_both_then_hmac_off() -> None:
    hmac_sig = signing.sign(ASSIGNMENT, [HMAC])  # bound before the upgrade
    # phase 1: sign HMAC, publish the Ed25519 key; nodes accept both
    phase1 = signing.parse_keyring(HMAC + b"\n" + PRIVATE.encode())
    assert signing.sign(ASSIGNMENT, phase1).startswith("v1.")
    node_both = signing.parse_keyring(HMAC + b"\n" + phase1.public_pems().encode(), private_ok=False)
    # phase 2: sign Ed25519; HMAC still verifies (pods bound in phase 1)
    phase2 = signing.parse_keyring(PRIVATE.encode() + HMAC + b"\n")
    ed_sig = signing.sign(ASSIGNMENT, phase2)
    assert ed_sig.startswith("v2.")
    assert _verify(hmac_sig, node_both) == _verify(ed_sig, node_both) == ASSIGNMENT
    assert _verify(hmac_sig, phase2) == ASSIGNMENT  # the extender still counts pods bound with HMAC
    # phase 3: HMAC off on the nodes
    with pytest.raises(signing.SignatureError, match="HMAC signatures are no longer accepted here"):
        _verify(hmac_sig, NODE)
    assert _verify(signing.sign(ASSIGNMENT, phase2), NODE) == ASSIGNMENT


def test_an_hmac_node_refuses_ed25519_with_a_clear_message() -> None:
    with pytest.raises(signing.SignatureError, match="no Ed25519 public key is configured here"):
        _verify(signing.sign(ASSIGNMENT, SCHEDULER), [HMAC])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no keys"),
        ("# only a comment\n", "no keys"),
        ("short\n", "entry 0 \\(an HMAC key\\) is 5 bytes"),
        ("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "entry 0 is not a readable PEM key"),
        ("-----BEGIN PUBLIC KEY-----\nAAAA\n", "no matching END line"),
        (
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "expected PRIVATE KEY or PUBLIC KEY",
        ),
    ],
)
def test_bad_key_material_gets_a_one_line_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        signing.parse_keyring(text, where="secret kxpu-system/k field keys")
    assert "\n" not in str(info.value) and str(info.value).startswith("secret kxpu-system/k field keys: ")


def test_a_non_ed25519_key_is_refused_by_name() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
    )
    with pytest.raises(ValueError, match=r"entry 0 is a .*PrivateKey, not an Ed25519 private key"):
        signing.parse_keyring(pem)


@pytest.mark.parametrize(
    ("signature", "message"),
    [
        ("v2", "form"),
        ("v2.a.b.c", "form"),
        ("v3.abcd1234.AAAA", "form"),
        ("v2.abcd1234.!!!!", "not base64url"),
        ("v2.zzzzzzzz.AAAA", "unknown Ed25519 key zzzzzzzz"),
        ("v2.\u00e9\u00e9.AAAA", "unknown Ed25519 key"),
        ("v1.abcd1234.AAAA", "HMAC signatures are no longer accepted"),
    ],
)
def test_garbage_signatures_are_refused_by_name(signature: str, message: str) -> None:
    with pytest.raises(signing.SignatureError, match=message) as info:
        _verify(signature, NODE)
    assert "\n" not in str(info.value)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_change_to_a_signed_assignment_or_its_signature_is_refused(data: st.DataObject) -> None:
    sig = signing.sign(ASSIGNMENT, SCHEDULER)
    target = data.draw(st.sampled_from(["text", "sig"]))
    original = TEXT if target == "text" else sig
    pos = data.draw(st.integers(0, len(original) - 1))
    char = data.draw(st.characters(codec="ascii").filter(lambda c: c != original[pos]))
    changed = original[:pos] + char + original[pos + 1 :]
    try:
        got = _verify(sig, NODE, text=changed) if target == "text" else _verify(changed, NODE)
    except signing.SignatureError:
        return
    # base64 may decode two spellings to the same bytes, and JSON may parse two texts to one value:
    # what verified must then be exactly what was signed
    assert got == ASSIGNMENT


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.text(max_size=120))
def test_garbage_annotations_only_ever_give_a_signature_error(text: str, signature: str) -> None:
    with pytest.raises(signing.SignatureError):
        _verify(signature, NODE, text=text)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_key_material_only_ever_gives_a_value_error(raw: bytes) -> None:
    try:
        signing.parse_keyring(raw)
    except ValueError as exc:
        assert "\n" not in str(exc)


async def test_the_node_keystore_joins_sources_and_refuses_a_private_key(tmp_path: Path) -> None:
    (tmp_path / "hmac").write_bytes(HMAC + b"\n")
    (tmp_path / "pub").write_text(SCHEDULER.public_pems())
    (tmp_path / "priv").write_text(PRIVATE)
    config = SharingConfig(
        signing_key=KeySource(file=tmp_path / "pub"),
        extra_keys=[KeySource(file=tmp_path / "hmac", hmac=True)],
    )
    store = KeyStore([config.signing_key, *config.extra_keys], lambda: None, private_ok=False)  # type: ignore[arg-type,return-value]
    ring = await store.get()
    assert ring.signer == HMAC  # HMAC can always sign; never used on a node
    assert _verify(signing.sign(ASSIGNMENT, SCHEDULER), ring) == ASSIGNMENT
    assert _verify(signing.sign(ASSIGNMENT, [HMAC]), ring) == ASSIGNMENT
    bad = KeyStore(KeySource(file=tmp_path / "priv"), lambda: None, private_ok=False)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=f"{tmp_path / 'priv'}: entry 0 is a private key"):
        await bad.get()


def test_a_key_source_names_exactly_one_place() -> None:
    with pytest.raises(ValueError, match="exactly one of secret"):
        KeySource(secret="a/b", config_map="a/c")
    with pytest.raises(ValueError, match="configMap 'x' must be namespace/name"):
        KeySource(config_map="x")
    assert KeySource(config_map="kxpu-system/kxpu-verify-keys").describe() == (
        "configmap kxpu-system/kxpu-verify-keys field keys"
    )


class _SecretsApi:
    """The two calls KeyStore makes for a Secret source, as lightkube's AsyncClient answers them (ApiError with
    the API server's Status: 404 when absent, 409 when another writer created it first)."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], Any] = {}
        self.creates = 0

    async def get(self, kind: Any, name: str, namespace: str) -> Any:
        from lightkube import ApiError
        from lightkube.models.meta_v1 import Status

        if (namespace, name) not in self.secrets:
            raise ApiError(status=Status(code=404, message=f'secrets "{name}" not found'))
        return self.secrets[(namespace, name)]

    async def create(self, obj: Any) -> Any:
        from lightkube import ApiError
        from lightkube.models.meta_v1 import Status

        key = (obj.metadata.namespace, obj.metadata.name)
        self.creates += 1
        if key in self.secrets:
            raise ApiError(status=Status(code=409, message="already exists"))
        self.secrets[key] = obj
        return obj


async def test_the_extender_makes_its_key_once_and_a_restart_keeps_it() -> None:
    """No key in any chart output: the extender creates the Secret on first start; the next start (or a second
    replica) reads the same key, so assignments already signed keep verifying."""
    from kxpu.sharing.control_plane import ControlPlaneConfig

    api = _SecretsApi()
    config = ControlPlaneConfig()
    assert config.signing_key == KeySource(secret="kxpu-system/kxpu-signing-ed25519", generate=True)
    first = await KeyStore(config.signing_key, lambda: api).load()  # type: ignore[arg-type,return-value]
    assert api.creates == 1 and isinstance(first.signer, Ed25519PrivateKey)
    stored = api.secrets[("kxpu-system", "kxpu-signing-ed25519")]
    assert stored.metadata.labels["app.kubernetes.io/managed-by"] == "kxpu"
    again = await KeyStore(config.signing_key, lambda: api).load()  # type: ignore[arg-type,return-value]
    assert api.creates == 1 and again.signer_id == first.signer_id
    # two replicas starting at once: both read "not found", the one whose create loses reads the winner's key
    racing = _SecretsApi()
    winner = await KeyStore(config.signing_key, lambda: racing).load()  # type: ignore[arg-type,return-value]
    real_get, misses = racing.get, [1]

    async def stale_get(kind: Any, name: str, namespace: str) -> Any:
        if misses:
            misses.pop()
            return await _SecretsApi().get(kind, name, namespace)  # read before the winner's create: 404
        return await real_get(kind, name, namespace)

    racing.get = stale_get  # type: ignore[method-assign]
    loser = await KeyStore(config.signing_key, lambda: racing).load()  # type: ignore[arg-type,return-value]
    assert racing.creates == 2 and loser.signer_id == winner.signer_id


async def test_a_missing_key_names_what_to_set() -> None:
    api = _SecretsApi()
    node = KeyStore(SharingConfig().signing_key, lambda: api, private_ok=False)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError) as info:
        await node.load()
    assert str(info.value) == (
        "configmap kxpu-system/kxpu-verify-keys does not exist; set sharing.signingKey to where the extender "
        "publishes its public keys (its publicKeysConfigMap, default kxpu-system/kxpu-verify-keys), and start "
        "the extender first"
    )
    own = KeyStore(KeySource(secret="ops/my-key"), lambda: api)  # type: ignore[arg-type,return-value]
    with pytest.raises(
        ValueError, match=r"^secret ops/my-key does not exist; set signingKey to an existing Secret"
    ):
        await own.load()
    assert api.creates == 0  # never made without generate: true


async def test_hmac_keys_are_read_only_from_a_source_named_hmac(tmp_path: Path) -> None:
    """The code's defaults are Ed25519 on both sides; a shared HMAC key is taken only where a source says so."""
    assert SharingConfig().signing_key == KeySource(config_map="kxpu-system/kxpu-verify-keys")
    (tmp_path / "hmac").write_bytes(HMAC + b"\n")
    plain = KeyStore(KeySource(file=tmp_path / "hmac"), lambda: None, private_ok=False)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="entry 0 is an HMAC key, but this source is not marked hmac: true"):
        await plain.load()
    named = KeyStore(KeySource(file=tmp_path / "hmac", hmac=True), lambda: None, private_ok=False)  # type: ignore[arg-type,return-value]
    assert _verify(signing.sign(ASSIGNMENT, [HMAC]), await named.load()) == ASSIGNMENT
    with pytest.raises(ValueError, match="generate: true is for the extender's signing key"):
        SharingConfig(signing_key=KeySource(secret="a/b", generate=True))
    with pytest.raises(ValueError, match="generate: true needs a secret"):
        KeySource(file=tmp_path / "hmac", generate=True)
