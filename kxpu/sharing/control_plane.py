"""The sharing control plane's config file (``kxpu scheduler --config`` and ``kxpu webhook --config``)::

version: v1
families:
  - resource: nvidia.com/gpu     # companions derived: nvidia.com/gpumem, gpumem-percentage, gpucores
  - resource: example.com/npu
    defaultMemoryMiB: 4096
nodePolicy: binpack
devicePolicy: spread
schedulerName: kxpu-scheduler
signingKey: {secret: kxpu-system/kxpu-signing-ed25519, generate: true}   # the default: made on first start
extraKeys: []                    # more key sources, verify only unless no earlier key can sign (HMAC: hmac: true)
publicKeysConfigMap: kxpu-system/kxpu-verify-keys   # where the nodes read the public keys (the default)
nodeLock: lease                  # or annotation (the Node object; before this release)
lockNamespace: kxpu-system
lockTimeoutSeconds: 60           # a lock whose pod was never bound expires after this
lockHardExpirySeconds: 600       # a bound pod never admitted (kubelet down) is failed after this
inventoryStaleSeconds: 120
trustedUsers: [system:serviceaccount:kxpu-system:kxpu-scheduler]   # may change kxpu's pod annotations
convertToClaims: false           # the webhook turns shared-device limits into DRA claims (kxpu/sharing/claims.py)
nodeUsers: [system:serviceaccount:kxpu-system:kxpu-node]     # may only mark pods bound to a node allocated
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from kxpu.dra.config import check_driver_name, default_driver_name
from kxpu.sharing.claims import ClaimFamily
from kxpu.sharing.config import DEFAULT_VERIFY_KEYS, KeySource
from kxpu.sharing.model import Policy
from kxpu.sharing.requests import ResourceFamily

# Env a shared container must not set itself (globs): HAMi-core's limits and the visible-device lists.
DEFAULT_PROTECTED_ENV = (
    "CUDA_DEVICE_MEMORY_LIMIT*",
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PIPE_DIRECTORY",
    "KXPU_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DEFAULT_ED25519_SECRET = "kxpu-system/kxpu-signing-ed25519"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class FamilyConfig(_Model):
    resource: str
    memory: str | None = None
    memory_percentage: str | None = None
    cores: str | None = None
    default_count: int = Field(default=1, ge=1)
    default_memory_mib: int | None = Field(default=None, ge=1, alias="defaultMemoryMiB")
    default_memory_percentage: int = Field(default=100, ge=1, le=100)
    default_cores: int = Field(default=0, ge=0, le=100)
    exclusive_when_count_only: bool = True
    # convertToClaims: the DeviceClass the family's claims name, and the DRA driver whose attributes their
    # selectors read; both default to the driver name kxpu's DRA driver derives (nvidia.com/gpu → gpu.nvidia.com),
    # which is also the name of the DeviceClass the chart renders for it.
    device_class_name: str | None = None
    driver_name: str | None = None

    @model_validator(mode="after")
    def _dra_names(self) -> FamilyConfig:
        # a name the API server would refuse is a config error naming the field, not a denial of every pod
        if self.driver_name is not None:
            check_driver_name(self.driver_name)
        else:
            default_driver_name(self.resource)
        name = self.device_class_name
        if name is not None and (len(name) > 253 or not _DNS_SUBDOMAIN.match(name)):
            raise ValueError(
                f"deviceClassName {name!r} must be a lowercase DNS subdomain (a DeviceClass's name)"
            )
        return self

    def claim_family(self) -> ClaimFamily:
        driver = self.driver_name or default_driver_name(self.resource)
        return ClaimFamily(self.family(), self.device_class_name or driver, driver)

    def family(self) -> ResourceFamily:
        return ResourceFamily.derived(
            self.resource,
            memory=self.memory,
            memory_percentage=self.memory_percentage,
            cores=self.cores,
            default_count=self.default_count,
            default_memory_mib=self.default_memory_mib,
            default_memory_percentage=self.default_memory_percentage,
            default_cores=self.default_cores,
            exclusive_when_count_only=self.exclusive_when_count_only,
        )


class ControlPlaneConfig(_Model):
    version: Literal["v1"] = "v1"
    families: list[FamilyConfig] = Field(
        default_factory=lambda: [FamilyConfig(resource="nvidia.com/gpu")], min_length=1
    )
    node_policy: Policy = Policy.BINPACK
    device_policy: Policy = Policy.SPREAD
    scheduler_name: str = "kxpu-scheduler"
    # an Ed25519 private key in a Secret the extender creates on first start (generate) and reads afterwards
    signing_key: KeySource = Field(
        default_factory=lambda: KeySource(secret=DEFAULT_ED25519_SECRET, generate=True)
    )
    # more key sources, joined after signingKey: the first key that can sign signs, all verify
    extra_keys: list[KeySource] = Field(default_factory=list)
    # the ConfigMap (namespace/name) where the extender publishes its Ed25519 public keys for the nodes
    public_keys_config_map: str | None = DEFAULT_VERIFY_KEYS
    # lease: one coordination.k8s.io Lease per node and family in lockNamespace (nodes that publish
    # kxpu.io/lock-protocol: lease; others keep the annotation); annotation: the Node annotation only
    node_lock: Literal["lease", "annotation"] = "lease"
    lock_namespace: str = "kxpu-system"
    lock_timeout_seconds: float = Field(default=60.0, gt=0)
    lock_hard_expiry_seconds: float = Field(default=600.0, gt=0)
    inventory_stale_seconds: float = Field(default=120.0, gt=0)
    # who may change kxpu's pod annotations and label (the webhook denies everyone else): the extender
    trusted_users: list[str] = Field(
        default_factory=lambda: ["system:serviceaccount:kxpu-system:kxpu-scheduler"]
    )
    # the node daemon's service account: may only set the allocated mark, on pods bound to a node (its own,
    # when its token names it)
    node_users: list[str] = Field(default_factory=lambda: ["system:serviceaccount:kxpu-system:kxpu-node"])

    # env names (globs) a shared container may not set itself; the webhook denies them
    protected_env: list[str] = Field(default_factory=lambda: list(DEFAULT_PROTECTED_ENV))
    # the DRA path: the webhook turns a pod's shared-device limits into consumable-capacity claims (from
    # ResourceClaimTemplates it creates) for the stock kube-scheduler, instead of sending it to the extender
    convert_to_claims: bool = False

    @model_validator(mode="after")
    def _hard_expiry_after_timeout(self) -> ControlPlaneConfig:
        if self.lock_hard_expiry_seconds < self.lock_timeout_seconds:
            raise ValueError(
                f"lockHardExpirySeconds ({self.lock_hard_expiry_seconds:g}) must be at least "
                f"lockTimeoutSeconds ({self.lock_timeout_seconds:g}): a bound pod gets at least as long "
                "to be admitted as an unbound one to be bound"
            )
        return self

    def resource_families(self) -> list[ResourceFamily]:
        return [f.family() for f in self.families]

    def claim_families(self) -> list[ClaimFamily]:
        return [f.claim_family() for f in self.families]


class SharingConfigError(Exception):
    pass


def load_control_plane_config(path: Path | None) -> ControlPlaneConfig:
    if path is None:
        return ControlPlaneConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SharingConfigError(f"{path}: {exc}") from None
    try:
        return ControlPlaneConfig.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_url=False)
        ]
        raise SharingConfigError(f"{path}: {'; '.join(lines)}") from None
