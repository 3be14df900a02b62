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

A process is given to the container of its pod that holds the device it runs on. When several
containers of one pod hold that device the pod is known but the container is not (left empty); a
process in no pod with kxpu devices (the MPS server, a host process) is left unattributed.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.api.podresources.v1 import api_pb2 as podres
from kxpu.api.podresources.v1 import api_pb2_grpc as podres_grpc
from kxpu.model import GRANT_ANNOTATION, Grant, GrantError, decode_grants

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


class CheckpointReader:
    """Re-reads the checkpoint only when its modification time or size changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None
        self.entries: list[CheckpointEntry] = []
        self.generation = 0  # moves whenever the entries were read again

    def refresh(self) -> bool:
        """True if the entries changed. HolderError if the file cannot be read or parsed."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if self._seen is not None or self.generation == 0:
                self._seen, self.entries = None, []
                self.generation += 1
                return True
            return False
        except OSError as exc:
            raise HolderError(f"kubelet checkpoint {self.path}: {exc.strerror}") from None
        key = (st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return False
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise HolderError(f"kubelet checkpoint {self.path}: {exc.strerror}") from None
        try:
            self.entries = parse_checkpoint(text)
        except HolderError as exc:
            raise HolderError(f"kubelet checkpoint {self.path}: {exc}") from None
        self._seen = key
        self.generation += 1
        return True


PlacedDevices = dict[
    tuple[str, str], tuple[str, str, str]
]  # (resource, device ID) → (namespace, pod, container)


async def list_pod_resources(socket: Path, timeout: float = 5.0) -> PlacedDevices:
    """The PodResources API's List, as (resource, device ID) → (namespace, pod, container)."""
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub: podres_grpc.PodResourcesListerAsyncStub = podres_grpc.PodResourcesListerStub(channel)
            response = await stub.List(podres.ListPodResourcesRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        raise HolderError(f"kubelet PodResources API at {socket}: {detail}") from None
    placed: PlacedDevices = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                for device_id in devices.device_ids:
                    placed[(devices.resource_name, device_id)] = (pod.namespace, pod.name, container.name)
    return placed


@dataclass(frozen=True, slots=True)
class Holder:
    """One container holding devices of one resource."""

    resource: str
    namespace: str
    pod: str
    container: str
    pod_uid: str
    uuids: frozenset[str]
    grants: Mapping[str, Grant] = field(default_factory=dict)  # device UUID → grant


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
class Attribution:
    namespace: str = ""
    pod: str = ""
    container: str = ""
    pod_uid: str = ""
    grant: Grant | None = None


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
        return Attribution(first.namespace, first.pod, first.container, owner.pod_uid, first.grants.get(uuid))
    return Attribution(first.namespace, first.pod, "", owner.pod_uid)
