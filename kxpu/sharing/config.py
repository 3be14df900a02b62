"""Config of fractional sharing on the node: a resource's ``sharing:`` section, the model kxpu/config.py composes.

It imports nothing else of kxpu.sharing, so loading the daemon's config loads no sharing logic; the control
plane's file (``kxpu scheduler`` and ``kxpu webhook --config``) is ``control_plane.py``.

Node side, on a resource of the daemon's config (the count resource is the resource's name)::

    resources:
      - name: example.com/npu
        simulated: {count: 4, memoryMiB: 16384, cores: 64}
        sharing:
          splitCount: 4              # slots per device the kubelet sees (IDs <id>::<n>)
          memoryScaling: 1.0         # > 1 overcommits memory
          coreScaling: 1.0           # > 1 overcommits cores
          nodeName: null             # default: $NODE_NAME
          signingKey: {configMap: kxpu-system/kxpu-verify-keys}   # the default; or {secret: ns/name} or {file: ...}
          extraKeys: []              # more sources (during the upgrade from HMAC: {secret: ns/name, hmac: true})
          lockNamespace: kxpu-system # the per-node lock Leases
          visibleDevicesEnv: KXPU_VISIBLE_DEVICES
          memoryLimitEnv: CUDA_DEVICE_MEMORY_LIMIT_{i}
          coreLimitEnv: CUDA_DEVICE_SM_LIMIT
          env: {}                    # extra env for every shared container
          mounts: []                 # e.g. HAMi-core's libvgpu.so and ld.so.preload
          publishIntervalSeconds: 30
          allocateTimeoutSeconds: 10
          maxAssignmentAgeSeconds: 600
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


DEFAULT_VERIFY_KEYS = "kxpu-system/kxpu-verify-keys"


class KeySource(_Model):
    """Where keys come from (``signing.parse_keyring``'s format): a Secret or ConfigMap (``namespace/name``,
    read through the API) or a file (a mounted Secret).

    Ed25519 keys only, unless ``hmac: true`` names the source as holding HMAC keys (shared secrets: every
    holder could sign; only for the upgrade from HMAC). ``generate: true`` (a Secret, the extender only): if
    the Secret does not exist, the extender creates it with a new key (Ed25519, or HMAC with ``hmac``), so no
    key is ever rendered by a chart or kept in its release history.
    """

    secret: str | None = None
    config_map: str | None = None
    field: str = "keys"
    file: Path | None = None
    hmac: bool = False
    generate: bool = False

    @model_validator(mode="after")
    def _one(self) -> KeySource:
        if sum(x is not None for x in (self.secret, self.config_map, self.file)) != 1:
            raise ValueError(
                "set exactly one of secret (namespace/name), configMap (namespace/name) and file"
            )
        if self.generate and self.secret is None:
            raise ValueError("generate: true needs a secret (namespace/name) to create")
        for kind, ref in (("secret", self.secret), ("configMap", self.config_map)):
            if ref is not None and ref.count("/") != 1:
                raise ValueError(f"{kind} {ref!r} must be namespace/name")
        return self

    @property
    def secret_ref(self) -> tuple[str, str]:
        assert self.secret is not None
        namespace, _, name = self.secret.partition("/")
        return namespace, name

    @property
    def config_map_ref(self) -> tuple[str, str]:
        assert self.config_map is not None
        namespace, _, name = self.config_map.partition("/")
        return namespace, name

    def describe(self) -> str:
        if self.file is not None:
            return str(self.file)
        kind = "secret" if self.secret is not None else "configmap"
        return f"{kind} {self.secret or self.config_map} field {self.field}"


class MountConfig(_Model):
    host_path: str
    container_path: str
    read_only: bool = True


class SharingConfig(_Model):
    """``sharing:`` on a daemon resource: advertise slots and answer Allocate from signed assignments."""

    split_count: int = Field(default=10, ge=1, le=1000)
    memory_scaling: float = Field(default=1.0, gt=0, le=100)
    core_scaling: float = Field(default=1.0, gt=0, le=100)
    node_name: str | None = None
    # the extender's Ed25519 public keys, as it publishes them (publicKeysConfigMap); HMAC only when a source
    # says hmac: true
    signing_key: KeySource = Field(default_factory=lambda: KeySource(config_map=DEFAULT_VERIFY_KEYS))
    # more key sources, joined after signingKey (during the upgrade from HMAC: the old HMAC Secret and the
    # extender's public keys); a node never accepts a private key
    extra_keys: list[KeySource] = Field(default_factory=list)
    # where the extender keeps the per-node lock Leases (nodeLock: lease)
    lock_namespace: str = "kxpu-system"
    visible_devices_env: str = "KXPU_VISIBLE_DEVICES"
    memory_limit_env: str = "CUDA_DEVICE_MEMORY_LIMIT_{i}"
    core_limit_env: str = "CUDA_DEVICE_SM_LIMIT"
    env: dict[str, str] = Field(default_factory=dict)
    mounts: list[MountConfig] = Field(default_factory=list)
    publish_interval_seconds: float = Field(default=30.0, gt=0)
    allocate_timeout_seconds: float = Field(default=10.0, gt=0)
    max_assignment_age_seconds: float = Field(default=600.0, gt=0)

    @field_validator("signing_key", "extra_keys")
    @classmethod
    def _no_generate(cls, value: KeySource | list[KeySource]) -> KeySource | list[KeySource]:
        for source in value if isinstance(value, list) else [value]:
            if source.generate:
                raise ValueError("generate: true is for the extender's signing key; nodes only read keys")
        return value

    @field_validator("memory_limit_env")
    @classmethod
    def _has_index(cls, value: str) -> str:
        if "{i}" not in value:
            raise ValueError("memoryLimitEnv needs {i} (the device's index in the container)")
        return value
