"""From a pod (as the API serves it, a plain mapping) to what it asks of each shared resource family.

A *family* is a count resource and its companions, e.g. ``nvidia.com/gpu`` (devices per
container), ``nvidia.com/gpumem`` (MiB per device), ``nvidia.com/gpumem-percentage`` and
``nvidia.com/gpucores`` (percent per device). Defaults, per family:

- only a count: each device whole — memory at ``default_memory_*`` (100 % unless
  configured) and, with ``exclusive_when_count_only``, 100 cores (exclusive); otherwise
  ``default_cores``;
- memory, a percentage or cores but no count: ``default_count`` devices;
- no memory: ``default_memory_mib`` if set, else ``default_memory_percentage`` % of the device;
- no cores: ``default_cores`` (0: no core limit, best-effort time-sharing).

Pod annotations (kxpu's names, and HAMi's for drop-in use; kxpu's win when both are set):
``kxpu.io/use-type`` / ``nouse-type`` (comma-separated model substrings, case-insensitive),
``kxpu.io/use-uuid`` / ``nouse-uuid`` (comma-separated UUIDs or device IDs),
``kxpu.io/numa-bind`` ("true": all of a container's devices on one NUMA node),
``kxpu.io/node-policy`` / ``kxpu.io/device-policy`` (``binpack`` or ``spread``). HAMi's are
``<domain>/use-<short>type`` etc. (``nvidia.com/use-gputype``), ``<domain>/numa-bind``,
``hami.io/node-scheduler-policy`` and ``hami.io/gpu-scheduler-policy``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kxpu.sharing.model import EXCLUSIVE_CORES, ContainerRequest, DeviceFilter, PodRequest, Policy

ANNOTATION_PREFIX = "kxpu.io/"
USE_TYPE = "kxpu.io/use-type"
NOUSE_TYPE = "kxpu.io/nouse-type"
USE_UUID = "kxpu.io/use-uuid"
NOUSE_UUID = "kxpu.io/nouse-uuid"
NUMA_BIND = "kxpu.io/numa-bind"
NODE_POLICY = "kxpu.io/node-policy"
DEVICE_POLICY = "kxpu.io/device-policy"
HAMI_NODE_POLICY = "hami.io/node-scheduler-policy"
HAMI_DEVICE_POLICY = "hami.io/gpu-scheduler-policy"


class RequestError(ValueError):
    """A pod asks for something that can never be granted; the message says what and where."""


@dataclass(frozen=True, slots=True)
class ResourceFamily:
    """The resource names of one shared device kind and its defaults."""

    count: str
    memory: str
    memory_percentage: str
    cores: str
    default_count: int = 1
    default_memory_mib: int | None = None
    default_memory_percentage: int = 100
    default_cores: int = 0
    exclusive_when_count_only: bool = True

    @classmethod
    def derived(
        cls,
        count: str,
        memory: str | None = None,
        memory_percentage: str | None = None,
        cores: str | None = None,
        **defaults: Any,
    ) -> ResourceFamily:
        """Companion names from the count's unless given: ``example.com/npu`` → ``example.com/npumem``, …"""
        return cls(
            count,
            memory or f"{count}mem",
            memory_percentage or f"{count}mem-percentage",
            cores or f"{count}cores",
            **defaults,
        )

    @property
    def names(self) -> tuple[str, str, str, str]:
        return (self.count, self.memory, self.memory_percentage, self.cores)

    @property
    def domain(self) -> str:
        return self.count.partition("/")[0]

    @property
    def short(self) -> str:
        return self.count.partition("/")[2]

    def hami_annotation(self, what: str) -> str:
        """HAMi's per-vendor annotation: ``use-type`` → ``nvidia.com/use-gputype``."""
        if what == "numa-bind":
            return f"{self.domain}/numa-bind"
        verb, _, kind = what.partition("-")
        return f"{self.domain}/{verb}-{self.short}{kind}"


_QUANTITY = re.compile(r"^([+]?[0-9]*\.?[0-9]+)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def parse_quantity(value: object, where: str) -> int:
    """A Kubernetes quantity that must be a whole number (``"3000"``, ``3000``, ``"3k"``)."""
    if isinstance(value, bool):
        raise RequestError(f"{where}: {value!r} is not a quantity")
    if isinstance(value, int):
        number = Decimal(value)
    else:
        text = str(value).strip()
        match = _QUANTITY.match(text)
        if match is None:
            raise RequestError(f"{where}: {value!r} is not a quantity")
        digits, suffix = match.groups()
        if suffix == "m":
            scale = Decimal(1) / 1000
        elif suffix in _SUFFIX:
            scale = Decimal(_SUFFIX[suffix])
        else:
            raise RequestError(f"{where}: {value!r} has an unknown suffix {suffix!r}")
        try:
            number = Decimal(digits) * scale
        except InvalidOperation:
            raise RequestError(f"{where}: {value!r} is not a quantity") from None
    if number != number.to_integral_value():
        raise RequestError(f"{where}: {value!r} must be a whole number")
    return int(number)


def _amounts(container: Mapping[str, Any], names: Sequence[str], where: str) -> dict[str, int]:
    resources = container.get("resources") or {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    out: dict[str, int] = {}
    for name in names:
        if name in limits:
            out[name] = parse_quantity(limits[name], f"{where} limits {name}")
            if name in requests and parse_quantity(requests[name], f"{where} requests {name}") != out[name]:
                raise RequestError(f"{where}: {name} request and limit must be equal")
        elif name in requests:
            out[name] = parse_quantity(requests[name], f"{where} requests {name}")
    return out


def container_request(family: ResourceFamily, container: str, amounts: Mapping[str, int]) -> ContainerRequest:
    """Apply the family's defaults to what a container names; raise RequestError if impossible."""
    where = f"container {container!r}"
    count = amounts.get(family.count)
    memory = amounts.get(family.memory)
    percentage = amounts.get(family.memory_percentage)
    cores = amounts.get(family.cores)
    count_only = count is not None and memory is None and percentage is None and cores is None
    if count is None:
        count = family.default_count
    if count < 1:
        raise RequestError(f"{where}: {family.count} must be at least 1 when asking for a share of it")
    if memory is not None and percentage is not None:
        raise RequestError(f"{where}: set {family.memory} or {family.memory_percentage}, not both")
    if memory is None and percentage is None:
        if family.default_memory_mib is not None:
            memory = family.default_memory_mib
        else:
            percentage = family.default_memory_percentage
    if memory is not None and memory < 1:
        raise RequestError(f"{where}: {family.memory} must be at least 1 (MiB)")
    if percentage is not None and not 1 <= percentage <= 100:
        raise RequestError(f"{where}: {family.memory_percentage} must be 1-100, not {percentage}")
    if cores is None:
        cores = EXCLUSIVE_CORES if count_only and family.exclusive_when_count_only else family.default_cores
    if not 0 <= cores <= EXCLUSIVE_CORES:
        raise RequestError(f"{where}: {family.cores} must be 0-100 (percent of a device), not {cores}")
    return ContainerRequest(container, count, memory, percentage, cores)


def _csv(value: str | None) -> frozenset[str]:
    if not value:
        return frozenset()
    return frozenset(p.strip() for p in value.split(",") if p.strip())


def _policy(value: str | None, annotation: str) -> Policy | None:
    if value is None:
        return None
    try:
        return Policy(value.strip().lower())
    except ValueError:
        raise RequestError(f"annotation {annotation}: {value!r} is not one of binpack, spread") from None


def _bool(value: str | None, annotation: str) -> bool:
    if value is None:
        return False
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no", ""):
        return False
    raise RequestError(f"annotation {annotation}: {value!r} is not true or false")


def _annotation(annotations: Mapping[str, str], ours: str, theirs: str) -> tuple[str | None, str]:
    if ours in annotations:
        return annotations[ours], ours
    return annotations.get(theirs), theirs


def requested_names(families: Sequence[ResourceFamily]) -> frozenset[str]:
    return frozenset(name for f in families for name in f.names)


def check_containers(
    spec: Mapping[str, Any], names: frozenset[str], protected_env: Sequence[str], setter: str
) -> None:
    """RequestError naming the container whose sharing limits could not hold: a privileged one asking for
    ``names`` (it sees every device), or any one, init containers too, setting an env variable that kxpu
    sets itself (``protected_env`` patterns; ``setter`` says from what). Any container may get the device
    without asking in limits (a claim listed in its resources.claims), so the env check spares none."""
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        asked = names & (set(resources.get("limits") or {}) | set(resources.get("requests") or {}))
        if asked and (container.get("securityContext") or {}).get("privileged"):
            raise RequestError(
                f"container {container.get('name')!r} is privileged and asks for {', '.join(sorted(asked))}: "
                "a privileged container sees every device, so sharing limits cannot hold"
            )
        # The kubelet appends the pod's env after the device plugin's (and the runtime after CDI's): a
        # container setting these itself could lift its limits or widen its devices (envFrom cannot be checked).
        own = [str(e.get("name", "")) for e in container.get("env") or []]
        clash = sorted(n for n in own if any(fnmatch.fnmatchcase(n, p) for p in protected_env))
        if clash:
            raise RequestError(f"container {container.get('name')!r} sets {', '.join(clash)}, which {setter}")


def _expect(value: Any, kind: type, where: str) -> Any:
    if value is not None and not isinstance(value, kind):
        what = "an object" if kind is dict else "a list" if kind is list else kind.__name__
        raise RequestError(f"{where}: expected {what}, got {type(value).__name__}")
    return value


def check_pod_shape(pod: Any) -> None:
    """RequestError naming the field if the pod object is not shaped as Kubernetes writes one (the extender's
    HTTP callers send JSON: a malformed one must get an answer saying what is wrong, not a traceback)."""
    if not isinstance(pod, dict):
        raise RequestError(f"pod: expected an object, got {type(pod).__name__}")
    meta = _expect(pod.get("metadata"), dict, "pod.metadata") or {}
    for field in ("annotations", "labels"):
        for key, value in (_expect(meta.get(field), dict, f"pod.metadata.{field}") or {}).items():
            if not isinstance(value, str):
                kind = type(value).__name__
                raise RequestError(f"pod.metadata.{field}[{key!r}]: expected a string, got {kind}")
    spec = _expect(pod.get("spec"), dict, "pod.spec") or {}
    for field in ("initContainers", "containers"):
        for n, container in enumerate(_expect(spec.get(field), list, f"pod.spec.{field}") or []):
            where = f"pod.spec.{field}[{n}]"
            _expect(container, dict, where)
            _expect(container.get("securityContext"), dict, f"{where}.securityContext")
            for m, env in enumerate(_expect(container.get("env"), list, f"{where}.env") or []):
                _expect(env, dict, f"{where}.env[{m}]")
            resources = _expect(container.get("resources"), dict, f"{where}.resources") or {}
            for kind in ("limits", "requests"):
                for name, value in (
                    _expect(resources.get(kind), dict, f"{where}.resources.{kind}") or {}
                ).items():
                    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                        raise RequestError(
                            f"{where}.resources.{kind}[{name!r}]: expected a quantity, got {type(value).__name__}"
                        )


def parse_pod(pod: Mapping[str, Any], families: Sequence[ResourceFamily]) -> list[PodRequest]:
    """One PodRequest per family the pod asks for (none: the pod is not ours)."""
    check_pod_shape(pod)
    spec = pod.get("spec") or {}
    annotations: Mapping[str, str] = (pod.get("metadata") or {}).get("annotations") or {}
    all_names = requested_names(families)
    for init in spec.get("initContainers") or []:
        asked = sorted(set(_amounts(init, sorted(all_names), "init container")) & all_names)
        if asked:
            raise RequestError(
                f"init container {init.get('name')!r} asks for {', '.join(asked)}: "
                "shared devices are for app containers only"
            )
    out: list[PodRequest] = []
    for family in families:
        containers: list[ContainerRequest] = []
        for container in spec.get("containers") or []:
            name = str(container.get("name", ""))
            amounts = _amounts(container, family.names, f"container {name!r}")
            if amounts:
                containers.append(container_request(family, name, amounts))
        if not containers:
            continue
        values = {
            what: _annotation(annotations, ANNOTATION_PREFIX + what, family.hami_annotation(what))
            for what in ("use-type", "nouse-type", "use-uuid", "nouse-uuid", "numa-bind")
        }
        device_filter = DeviceFilter(
            use_types=frozenset(t.lower() for t in _csv(values["use-type"][0])),
            nouse_types=frozenset(t.lower() for t in _csv(values["nouse-type"][0])),
            use_uuids=_csv(values["use-uuid"][0]),
            nouse_uuids=_csv(values["nouse-uuid"][0]),
        )
        node_policy, node_key = _annotation(annotations, NODE_POLICY, HAMI_NODE_POLICY)
        device_policy, device_key = _annotation(annotations, DEVICE_POLICY, HAMI_DEVICE_POLICY)
        out.append(
            PodRequest(
                resource=family.count,
                containers=tuple(containers),
                device_filter=device_filter,
                numa_bind=_bool(*values["numa-bind"]),
                node_policy=_policy(node_policy, node_key),
                device_policy=_policy(device_policy, device_key),
            )
        )
    return out
