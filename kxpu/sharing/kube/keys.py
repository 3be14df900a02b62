"""The HMAC keys, from a Kubernetes Secret (read through the API) or a file (a mounted Secret).

The Secret's field holds one key per line, the first signs (``signing.parse_keys``).
Keys are re-read every ``refresh_s`` so a rotation (add the new key first, keep the old
one second until no assignment signed with it can still be pending) needs no restart.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Secret

from kxpu.logs import get_logger
from kxpu.sharing.config import KeySource
from kxpu.sharing.signing import parse_keys

log = get_logger("kxpu.sharing.kube.keys")


class KeyStore:
    def __init__(self, source: KeySource, client: Callable[[], AsyncClient], refresh_s: float = 60.0) -> None:
        self.source = source
        self._client = client
        self.refresh_s = refresh_s
        self._keys: list[bytes] = []
        self._loaded_at = 0.0

    async def load(self) -> list[bytes]:
        if self.source.file is not None:
            text = self.source.file.read_bytes()
        else:
            namespace, name = self.source.secret_ref
            secret = await self._client().get(Secret, name, namespace=namespace)
            data = (secret.data or {}).get(self.source.field)
            if data is None:
                raise ValueError(f"secret {namespace}/{name} has no field {self.source.field!r}")
            text = base64.b64decode(data)
        keys = parse_keys(text)
        if keys != self._keys:
            log.info("signing keys loaded", keys=len(keys))
        self._keys, self._loaded_at = keys, time.monotonic()
        return keys

    async def get(self) -> list[bytes]:
        if not self._keys or time.monotonic() - self._loaded_at > self.refresh_s:
            try:
                return await self.load()
            except Exception as exc:
                if not self._keys:
                    raise
                log.warning("could not refresh the signing keys; using the last ones", error=str(exc))
        return self._keys

    def current(self) -> list[bytes]:
        """The last loaded keys (the extender refreshes them in the background)."""
        if not self._keys:
            raise RuntimeError("signing keys are not loaded yet")
        return self._keys
