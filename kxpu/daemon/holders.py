"""Which pod and container a process on a device belongs to, and what that container was granted.

Three sources, all on the node, none of them the API server:

- ``<hostRoot>/proc/<pid>/cgroup``: the pod UID of a process (the kubelet names pod cgroups
  ``pod<uid>``: ``/kubepods/burstable/pod<uid>/<container id>`` with the cgroupfs driver,
  ``…-pod<uid with _>.slice/cri-containerd-<id>.scope`` with systemd's; cgroup v1 and v2 alike).
  Drivers report PIDs in the host's PID namespace, so the daemon needs the host's /proc.
- the kubelet's device checkpoint (``kubelet_internal_checkpoint`` in the device-plugin directory,
  the file the kubelet re-reads after a restart): per pod UID and container name, the device IDs of
  each resource, and the Allocate response the container got, whose ``kxpu.io/grants`` annotation
  says what share of each device kxpu granted it. Read again only when the file changes.
- the PodResources API: the namespace and name of the pod each device ID is allocated to (it has no
  pod UIDs, the checkpoint has no names; the device IDs, each allocated to one container at a time,
  join the two).

Devices allocated through DRA are joined the same way from three other sources: PodResources'
``dynamic_resources`` (which container uses which claim, and the driver/pool/device/share of each of
its devices), the driver's own prepared-claim checkpoint (claim UID → namespace/name, the kxpu device
and, for a share, its grant) and the claim's ``status.reservedFor`` (claim UID → the UIDs of the pods
using it: PodResources has no UIDs, as on the device-plugin side), which the DRA driver has from its
watch-fed claim cache or a GET (``DraPlugin.claim_pods``). Not the kubelet's own DRA checkpoint
(``dra_manager_state``): it sits in the kubelet's root directory, which a pod cannot mount without its
other pods' secrets, and the kubelet replaces the file on every write, so a single-file mount goes stale.

A process is given to the container of its pod that holds the device it runs on. When several
containers of one pod hold that device the pod is known but the container is not (left empty); a
process in no pod with kxpu devices (the MPS server, a host process) is left unattributed.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

import grpc

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.api.podresources.v1 import api_pb2 as podres
from kxpu.api.podresources.v1 import api_pb2_grpc as podres_grpc
from kxpu.model.telemetry import GRANT_ANNOTATION, MIB, Grant, GrantError, decode_grants

if TYPE_CHECKING:
    from kxpu.dra.checkpoint import PreparedClaim

_T = TypeVar("_T")

_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER_ID = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")


class HolderError(Exception):
    """A source of the join could not be read; the message names it."""


@dataclass(frozen=True, slots=True)
class ProcessOwner:
    pod_uid: str
    container_id: str | None = None


def owner_of(host_root: Path, pid: int) -> ProcessOwner | None:
    """The pod (and container) a host PID runs in, from its cgroup paths; None outside any pod."""
    try:
        text = (host_root / "proc" / str(pid) / "cgroup").read_text()
    except (OSError, UnicodeDecodeError):
        return None  # gone, or not ours to read
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        found = _POD_UID.search(path)
        if found is None:
            continue
        container = _CONTAINER_ID.search(path)
        return ProcessOwner(found.group(1).replace("_", "-"), container.group(1) if container else None)
    return None


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    pod_uid: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    grants: tuple[Grant, ...] = ()


def parse_checkpoint(text: str) -> list[CheckpointEntry]:
    """The kubelet's device checkpoint: ``{"Data": {"PodDeviceEntries": [{"PodUID", "ContainerName",
    "ResourceName", "DeviceIDs": {"<numa>": [ids]}, "AllocResp": base64}]}, "Checksum": …}``."""
    try:
        data = json.loads(text)["Data"]
        raw_entries = data.get("PodDeviceEntries") or []
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HolderError(f"not a kubelet device checkpoint: {exc!r}") from None
    entries = []
    for raw in raw_entries:
        try:
            ids = raw.get("DeviceIDs") or {}
            # keyed by NUMA node since Kubernetes 1.20; a flat list before
            flat = [d for v in ids.values() for d in v] if isinstance(ids, dict) else list(ids)
            alloc = base64.b64decode(raw.get("AllocResp") or "")
            entries.append(
                CheckpointEntry(
                    str(raw["PodUID"]),
                    str(raw["ContainerName"]),
                    str(raw["ResourceName"]),
                    tuple(str(d) for d in flat),
                    _grants(alloc),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # one odd entry must not hide the others
    return entries


def _grants(alloc_response: bytes) -> tuple[Grant, ...]:
    if not alloc_response:
        return ()
    try:
        response = pb.ContainerAllocateResponse.FromString(alloc_response)
    except Exception:  # protobuf's DecodeError; the kubelet wrote it, so this is rare
        return ()
    text = response.annotations.get(GRANT_ANNOTATION)
    if text is None:
        return ()
    try:
        return tuple(decode_grants(text))
    except GrantError:
        return ()


class _WatchedFile(Generic[_T]):
    """A kubelet file re-read only when its modification time or size changes."""

    what = "file"

    def __init__(self, path: Path, parse: Callable[[str], _T], empty: _T) -> None:
        self.path = path
        self._parse = parse
        self._empty = empty
        self._seen: tuple[int, int] | None = None
        self.value: _T = empty
        self.generation = 0  # moves whenever the file was read again

    def refresh(self) -> bool:
        """True if the contents changed. HolderError if the file cannot be read or parsed."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if self._seen is not None or self.generation == 0:
                self._seen, self.value = None, self._empty
                self.generation += 1
                return True
            return False
        except OSError as exc:
            raise HolderError(f"{self.what} {self.path}: {exc.strerror}") from None
        key = (st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return False
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise HolderError(f"{self.what} {self.path}: {exc.strerror}") from None
        try:
            self.value = self._parse(text)
        except HolderError as exc:
            raise HolderError(f"{self.what} {self.path}: {exc}") from None
        self._seen = key
        self.generation += 1
        return True


class CheckpointReader(_WatchedFile[list[CheckpointEntry]]):
    """The kubelet's device checkpoint, re-read only when it changes."""

    what = "kubelet checkpoint"

    def __init__(self, path: Path) -> None:
        super().__init__(path, parse_checkpoint, [])

    @property
    def entries(self) -> list[CheckpointEntry]:
        return self.value


ClaimPods = dict[str, frozenset[str]]  # claim UID → UIDs of the pods using it (its status.reservedFor)


PlacedDevices = dict[
    tuple[str, str], tuple[str, str, str]
]  # (resource, device ID) → (namespace, pod, container)


@dataclass(frozen=True, slots=True)
class ClaimPlacement:
    """One device a container got through a DRA claim, as PodResources' ``dynamic_resources`` tells it."""

    namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim: str
    driver: str
    pool: str
    device: str
    share_id: str = ""


@dataclass(frozen=True, slots=True)
class PodResourcesView:
    devices: PlacedDevices = field(default_factory=dict)  # the device-plugin side
    claims: tuple[ClaimPlacement, ...] = ()  # the DRA side


async def read_pod_resources(socket: Path, timeout: float = 5.0) -> PodResourcesView:
    """The PodResources API's List over a channel of its own (a one-off read: ``kxpu status``, the DRA driver)."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        return await _list(channel, socket, timeout)


class PodResourcesClient:
    """PodResources' List over one channel kept between reads, for a caller that asks again and again (telemetry):
    a channel made per read costs about 0.05 MB of RSS per 100 reads that is never given back, a kept one
    nothing. After a failed read (the kubelet restarted, its socket replaced) the next read opens a new one."""

    def __init__(self) -> None:
        self._socket: Path | None = None
        self._channel: grpc.aio.Channel | None = None

    async def read(self, socket: Path, timeout: float = 5.0) -> PodResourcesView:
        if self._channel is None or socket != self._socket:
            await self.close()
            # its own subchannel: one shared with the failed channel would still be backing off from the old socket
            self._socket, self._channel = (
                socket,
                grpc.aio.insecure_channel(
                    f"unix://{socket}", options=[("grpc.use_local_subchannel_pool", 1)]
                ),
            )
        try:
            return await _list(self._channel, socket, timeout)
        except HolderError:
            await self.close()
            raise

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)


async def _list(channel: grpc.aio.Channel, socket: Path, timeout: float) -> PodResourcesView:
    """The PodResources API's List: device-plugin devices and DRA claims' devices, per container."""
    try:
        stub: podres_grpc.PodResourcesListerAsyncStub = podres_grpc.PodResourcesListerStub(channel)
        response = await stub.List(podres.ListPodResourcesRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        raise HolderError(f"kubelet PodResources API at {socket}: {detail}") from None
    placed: PlacedDevices = {}
    claims: list[ClaimPlacement] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                for device_id in devices.device_ids:
                    placed[(devices.resource_name, device_id)] = (pod.namespace, pod.name, container.name)
            for dynamic in container.dynamic_resources:
                for res in dynamic.claim_resources:
                    claims.append(
                        ClaimPlacement(
                            pod.namespace,
                            pod.name,
                            container.name,
                            dynamic.claim_namespace,
                            dynamic.claim_name,
                            res.driver_name,
                            res.pool_name,
                            res.device_name,
                            res.share_id if res.HasField("share_id") else "",
                        )
                    )
    return PodResourcesView(placed, tuple(claims))


async def list_pod_resources(socket: Path, timeout: float = 5.0) -> PlacedDevices:
    """The PodResources API's List, as (resource, device ID) → (namespace, pod, container)."""
    return (await read_pod_resources(socket, timeout)).devices


@dataclass(frozen=True, slots=True)
class Holder:
    """One container holding devices of one resource."""

    resource: str
    namespace: str
    pod: str
    container: str
    pod_uid: (
        str  # "" where it could not be told (a DRA claim whose reservedFor was not read, or is ambiguous)
    )
    uuids: frozenset[str]
    grants: Mapping[str, Grant] = field(default_factory=dict)  # device UUID → grant
    claim: str = ""  # namespace/name of the DRA claim it holds the devices by; "" for the device plugin


def build_holders(
    entries: Iterable[CheckpointEntry],
    placed: PlacedDevices,
    uuid_of: Mapping[str, Mapping[str, str]],
) -> dict[str, list[Holder]]:
    """Pod UID → its containers' holdings of the resources in ``uuid_of`` (resource → device ID → UUID)."""
    by_pod: dict[str, list[Holder]] = {}
    for entry in entries:
        ids = uuid_of.get(entry.resource)
        if ids is None or not entry.device_ids:
            continue
        names = next(
            (placed[(entry.resource, d)] for d in entry.device_ids if (entry.resource, d) in placed), None
        )
        if names is None:
            continue  # in the checkpoint but no longer in a running pod
        namespace, pod, container = names
        uuids = frozenset(ids[d] for d in entry.device_ids if d in ids)
        by_pod.setdefault(entry.pod_uid, []).append(
            Holder(
                entry.resource,
                namespace,
                pod,
                container,
                entry.pod_uid,
                uuids,
                {g.uuid: g for g in entry.grants},
            )
        )
    return by_pod


@dataclass(frozen=True, slots=True)
class DraClaims:
    """One DRA-served resource's prepared claims (the driver's checkpoint: claim UID → claim)."""

    resource: str
    driver: str
    claims: Mapping[str, PreparedClaim]
    uuid_of: Mapping[str, str]  # kxpu device ID → UUID


def _prepared_uuid(dra: DraClaims, device_id: str, partition: Mapping[str, str | int] | None) -> str:
    """A partition made for the claim has its own UUID (a MIG device's), kept in its release handle."""
    made = (partition or {}).get("uuid")
    return made if isinstance(made, str) and made else dra.uuid_of.get(device_id, device_id)


def _by_ref(sources: Iterable[DraClaims]) -> dict[tuple[str, str, str], tuple[DraClaims, str, PreparedClaim]]:
    """(driver, claim namespace, claim name) → the source, claim UID and prepared claim."""
    return {
        (dra.driver, claim.namespace, claim.name): (dra, uid, claim)
        for dra in sources
        for uid, claim in dra.claims.items()
    }


def placed_claims(
    sources: Iterable[DraClaims], placements: Iterable[ClaimPlacement]
) -> dict[str, frozenset[tuple[str, str]]]:
    """Prepared claim UID → the pods (namespace, name) PodResources says use it now."""
    return {uid: frozenset(pods) for uid, pods in _pods_by_claim(_by_ref(sources), placements).items()}


def _pods_by_claim(
    by_ref: Mapping[tuple[str, str, str], tuple[DraClaims, str, PreparedClaim]],
    placements: Iterable[ClaimPlacement],
) -> dict[str, set[tuple[str, str]]]:
    """Prepared claim UID → the pods (namespace, name) placed on it; reads ``placements`` once."""
    names: dict[str, set[tuple[str, str]]] = {}
    for p in placements:
        if (found := by_ref.get((p.driver, p.claim_namespace, p.claim))) is not None:
            names.setdefault(found[1], set()).add((p.namespace, p.pod))
    return names


def build_dra_holders(
    sources: Iterable[DraClaims],
    placements: Iterable[ClaimPlacement],
    claim_pods: ClaimPods,
    known_pods: Mapping[tuple[str, str], str] | None = None,
) -> list[Holder]:
    """The containers holding DRA-prepared devices: PodResources' placements joined with each driver's checkpoint
    (by driver, claim namespace/name, pool, device and share) and, for the pod UID, with the claims'
    ``status.reservedFor`` (claim UID → pod UIDs). ``known_pods`` ((namespace, pod) → UID, from the device-plugin
    side) settles claims shared by several pods. A device prepared for no running container is left out."""
    by_ref = _by_ref(sources)
    placements = [p for p in placements if (p.driver, p.claim_namespace, p.claim) in by_ref]
    # Pod UIDs: reservedFor names a claim's pods by UID, PodResources by name.
    uid_of: dict[tuple[str, str], str] = dict(known_pods or {})
    names_of = _pods_by_claim(by_ref, placements)  # claim UID → pods using it, by name
    for _ in range(2):  # a pod told apart on one claim may settle another it shares
        for claim_uid, names in names_of.items():
            uids = set(claim_pods.get(claim_uid, ()))
            left = {n for n in names if n not in uid_of}
            uids -= {uid_of[n] for n in names if n in uid_of}
            if len(left) == 1 and len(uids) == 1:
                uid_of[left.pop()] = uids.pop()
    held: dict[tuple[str, str, str, str, str], tuple[set[str], dict[str, Grant]]] = {}
    for p in placements:
        dra, _, claim = by_ref[(p.driver, p.claim_namespace, p.claim)]
        for prepared in claim.devices:
            if (prepared.pool, prepared.device, prepared.share_id or "") != (p.pool, p.device, p.share_id):
                continue
            uuid = _prepared_uuid(dra, prepared.id, prepared.partition)
            uuids, grants = held.setdefault(
                (dra.resource, p.namespace, p.pod, p.container, claim.ref), (set(), {})
            )
            uuids.add(uuid)
            if prepared.share_id and (prepared.memory_mib is not None or prepared.cores is not None):
                grants[uuid] = Grant(
                    uuid,
                    None if prepared.memory_mib is None else prepared.memory_mib * MIB,
                    None if prepared.cores is None else prepared.cores / 100,
                )
    return [
        Holder(
            resource,
            namespace,
            pod,
            container,
            uid_of.get((namespace, pod), ""),
            frozenset(uuids),
            grants,
            ref,
        )
        for (resource, namespace, pod, container, ref), (uuids, grants) in sorted(held.items())
    ]


@dataclass(frozen=True, slots=True)
class Attribution:
    namespace: str = ""
    pod: str = ""
    container: str = ""
    pod_uid: str = ""
    grant: Grant | None = None
    claim: str = ""  # namespace/name of the DRA claim the container holds the device by


def attribute(owner: ProcessOwner | None, uuid: str, holders: Mapping[str, list[Holder]]) -> Attribution:
    """Which container a process on device ``uuid`` belongs to (see the module's note on ambiguity)."""
    if owner is None:
        return Attribution()
    pods = holders.get(owner.pod_uid)
    if not pods:
        return Attribution(pod_uid=owner.pod_uid)
    on_device = [h for h in pods if uuid in h.uuids]
    names = {h.container for h in on_device}
    first = on_device[0] if on_device else pods[0]
    if len(names) == 1:
        claims = {h.claim for h in on_device}
        grant = next((g for h in on_device if (g := h.grants.get(uuid)) is not None), None)
        claim = claims.pop() if len(claims) == 1 else ""
        return Attribution(first.namespace, first.pod, first.container, owner.pod_uid, grant, claim)
    return Attribution(first.namespace, first.pod, "", owner.pod_uid)
