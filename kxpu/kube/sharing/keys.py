"""The signing keys, from Secrets or ConfigMaps (read through the API) or files (a mounted Secret).

Each source holds entries in the ``signing.parse_keyring`` format (Ed25519 PEM blocks, HMAC lines);
the sources are read in order and joined, so the first entry that can sign, in the first source
that has one, signs. Keys are re-read every ``refresh_s`` so a rotation (publish the new public key
first, sign with the new key next, drop the old one once no assignment signed with it can still be
pending: docs/sharing.md) needs no restart.

The node side (``private_ok=False``) refuses a source holding a private key: nodes verify only.
The extender publishes the public keys of its keyring (``publish_public_keys``) in a ConfigMap
the nodes read, so the private key never leaves the extender's pod.

A Secret source with ``generate: true`` that does not exist is created by the extender with a new key
(``create`` is atomic: of two replicas starting at once, one creates it and the other reads it). The
key is then never in a chart's output, so a re-render (``helm template`` in a GitOps sync) or an upgrade
keeps it, and no Helm release revision ever holds it.
"""

from __future__ import annotations

import base64
import secrets
import time
from collections.abc import Callable, Sequence

from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Secret

from kxpu.kube.client import get_or_none, is_status
from kxpu.logs import error_text, get_logger
from kxpu.sharing.config import KeySource
from kxpu.sharing.signing import Keyring, generate_private_pem, parse_keyring

log = get_logger("kxpu.kube.sharing.keys")


class KeyStore:
    def __init__(
        self,
        source: KeySource | Sequence[KeySource],
        client: Callable[[], AsyncClient],
        refresh_s: float = 60.0,
        *,
        private_ok: bool = True,
    ) -> None:
        self.sources = [source] if isinstance(source, KeySource) else list(source)
        self._client = client
        self.refresh_s = refresh_s
        self.private_ok = private_ok
        self._keys = Keyring()
        self._loaded_at = 0.0

    @property
    def source(self) -> KeySource:
        return self.sources[0]

    async def _read(self, source: KeySource) -> bytes:
        if source.file is not None:
            try:
                return source.file.read_bytes()
            except OSError as exc:
                raise ValueError(f"{source.file}: {exc.strerror}; {self._hint(source)}") from None
        if source.config_map is not None:
            namespace, name = source.config_map_ref
            cm = await get_or_none(self._client(), ConfigMap, name, namespace)
            if cm is None:
                raise ValueError(f"configmap {namespace}/{name} does not exist; {self._hint(source)}")
            text = (cm.data or {}).get(source.field)
            if text is None:
                raise ValueError(f"configmap {namespace}/{name} has no field {source.field!r}")
            return str(text).encode()
        namespace, name = source.secret_ref
        secret = await get_or_none(self._client(), Secret, name, namespace)
        if secret is None:
            if not (source.generate and self.private_ok):
                raise ValueError(f"secret {namespace}/{name} does not exist; {self._hint(source)}")
            secret = await self._generate(source)
        data = (secret.data or {}).get(source.field)
        if data is None:
            raise ValueError(f"secret {namespace}/{name} has no field {source.field!r}")
        return base64.b64decode(data)

    def _hint(self, source: KeySource) -> str:
        """What to set, for a key source that is not there (one line)."""
        if not self.private_ok:
            return (
                "set sharing.signingKey to where the extender publishes its public keys (its publicKeysConfigMap, "
                "default kxpu-system/kxpu-verify-keys), and start the extender first"
            )
        return (
            "set signingKey to an existing Secret holding an Ed25519 private key (openssl genpkey -algorithm "
            "ed25519), or add generate: true to have the extender create it"
        )

    async def _generate(self, source: KeySource) -> Secret:
        """Create the missing Secret with a new key; if another replica just did, read theirs."""
        namespace, name = source.secret_ref
        text = (secrets.token_urlsafe(48) + "\n") if source.hmac else generate_private_pem()
        meta = ObjectMeta(
            name=name,
            namespace=namespace,
            labels={"app.kubernetes.io/component": "scheduler", "app.kubernetes.io/managed-by": "kxpu"},
            annotations={
                "kxpu.io/generated-by": "kxpu scheduler (signingKey.generate): never rendered by the chart. "
                "Rotate by putting a new key first, then dropping the old one (docs/sharing.md)"
            },
        )
        body = Secret(
            metadata=meta, type="Opaque", data={source.field: base64.b64encode(text.encode()).decode()}
        )
        try:
            created = await self._client().create(body)
        except ApiError as exc:
            if not is_status(exc, 409):
                raise
            return await self._client().get(Secret, name, namespace=namespace)
        log.info(
            "generated a signing key", secret=f"{namespace}/{name}", kind="hmac" if source.hmac else "ed25519"
        )
        return created

    async def load(self) -> Keyring:
        ring = Keyring()
        for source in self.sources:
            text = await self._read(source)
            ring = ring + parse_keyring(
                text, private_ok=self.private_ok, where=source.describe(), hmac_ok=source.hmac
            )
        if ring != self._keys:
            log.info("signing keys loaded", keys=ring.describe())
        self._keys, self._loaded_at = ring, time.monotonic()
        return ring

    async def get(self, fresh: bool = False) -> Keyring:
        """The keys, read again when older than ``refresh_s`` (``fresh``: older than a second)."""
        age = time.monotonic() - self._loaded_at
        if not self._keys or age > self.refresh_s or (fresh and age > 1.0):
            try:
                return await self.load()
            except Exception as exc:
                if not self._keys:
                    raise
                log.warning("could not refresh the signing keys; using the last ones", error=error_text(exc))
        return self._keys

    def current(self) -> Keyring:
        """The last loaded keys (the extender refreshes them in the background)."""
        if not self._keys:
            raise RuntimeError("signing keys are not loaded yet")
        return self._keys


async def publish_public_keys(client: AsyncClient, ref: str, ring: Keyring, field: str = "keys") -> bool:
    """Write the keyring's Ed25519 public keys to ConfigMap ``ref`` (namespace/name) if they changed.

    True if it wrote. Nothing secret is written: public PEM blocks only, never an HMAC key.
    """
    text = ring.public_pems()
    if not text:
        return False
    namespace, _, name = ref.partition("/")
    current = await get_or_none(client, ConfigMap, name, namespace)
    if current is None:
        meta = ObjectMeta(name=name, namespace=namespace, labels={"app.kubernetes.io/component": "sharing"})
        await client.create(ConfigMap(metadata=meta, data={field: text}))
        log.info("published the public keys", configmap=ref, keys=ring.describe())
        return True
    if (current.data or {}).get(field) == text:
        return False
    current.data = {**(current.data or {}), field: text}
    await client.replace(current)
    log.info("published the public keys", configmap=ref, keys=ring.describe())
    return True
