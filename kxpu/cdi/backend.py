"""CDI output for any backend: a wrapper that keeps a CDI spec in step with discovery.

The daemon stays vendor- and CDI-agnostic: the CLI wraps a resource's backend when its
config says ``cdi: {enabled: true}``. Every device list the backend reports rewrites the
spec (atomically, and only when its content changes); it outlives the daemon. Allocate
then names the devices (``<kind>=<id>`` in ``cdi_devices``, optionally in a
``cdi.k8s.io/`` annotation) and the runtime injects their device nodes and mounts.

Env needs care: CDI applies each device's env in turn, so a value that lists the
allocated devices (``KXPU_VISIBLE_DEVICES=a,b``) would end up naming only the last device.
The spec therefore carries only env values that are the same whatever set is allocated;
set-dependent values travel in the Allocate response as before. Device nodes and mounts
that the spec provides for the allocated devices are not repeated in the response.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

from kxpu.cdi.spec import (
    annotation_key,
    build_spec,
    is_device_name,
    qualified_name,
    validate_spec,
    write_spec,
)
from kxpu.logs import get_logger
from kxpu.model import (
    Backend,
    BackendError,
    Closable,
    ContainerEdits,
    Device,
    DeviceShare,
    NodeLabeller,
    PreferredAllocator,
    PreStarter,
    ShareAllocator,
    Watcher,
)

log = get_logger("kxpu.cdi")

_ENV_UNSAFE = re.compile(r"[^A-Z0-9_]")


class CdiBackend(Backend):
    """Decorates ``inner``; use ``with_cdi`` so that optional capabilities carry over."""

    def __init__(self, inner: Backend, resource: str, kind: str, spec_dir: Path, annotations: bool) -> None:
        self.inner = inner
        self.resource = resource
        self.kind = kind
        self.spec_dir = spec_dir
        self.annotations = annotations
        self.spec_path: Path | None = None
        self._written: dict[str, object] | None = None
        # Why the spec for the current devices is not on disk (unwritable directory, invalid content):
        # Allocate refuses then, rather than hand out names the runtime cannot resolve.
        self._unwritten: str | None = None
        self._per_device: dict[str, ContainerEdits] = {}
        self.log = log.bind(resource=resource, kind=kind)

    # ------------------------------------------------------------------ keeping the spec in step
    def _edits_for_spec(self, devices: Sequence[Device]) -> list[tuple[str, ContainerEdits]]:
        singles: dict[str, ContainerEdits] = {}
        for device in devices:
            if not is_device_name(device.id):
                self.log.error("device ID is not a valid CDI device name; left out of the spec", id=device.id)
                continue
            try:
                singles[device.id] = self.inner.allocate([device])
            except Exception as exc:
                self.log.debug(
                    "no CDI edits for a device the backend will not allocate", id=device.id, error=str(exc)
                )
        try:
            together = self.inner.allocate([d for d in devices if d.id in singles]).env if singles else {}
        except Exception:
            together = None  # e.g. a backend that refuses multi-device requests
        constant: set[str] = set()
        keys = {k for edits in singles.values() for k in edits.env}
        for key in keys:
            values = {edits.env.get(key) for edits in singles.values()}
            if len(values) == 1 and None not in values and (together is None or together.get(key) in values):
                constant.add(key)
        out: list[tuple[str, ContainerEdits]] = []
        for device_id, edits in singles.items():
            spec_edits = ContainerEdits(
                env={k: v for k, v in edits.env.items() if k in constant},
                mounts=list(edits.mounts),
                device_nodes=list(edits.device_nodes),
            )
            if not (spec_edits.env or spec_edits.mounts or spec_edits.device_nodes):
                # CDI refuses a device with no edits; name the device so the entry is never empty.
                marker = "KXPU_CDI_DEVICE_" + _ENV_UNSAFE.sub("_", device_id.upper())
                spec_edits.env[marker] = qualified_name(self.kind, device_id)
            out.append((device_id, spec_edits))
        self._per_device = dict(out)
        return out

    def _sync(self, devices: Sequence[Device]) -> None:
        entries = self._edits_for_spec(devices)
        if not entries:
            self._remove_spec()
            self._unwritten = None
            return
        spec = build_spec(self.kind, entries)
        if spec == self._written:
            return
        errors = validate_spec(spec)
        if errors:
            self._unwritten = f"it would be invalid: {'; '.join(errors)}"
            self.log.error("CDI spec would be invalid; not written", errors=errors)
            return
        try:
            self.spec_path = write_spec(self.spec_dir, spec)
        except OSError as exc:
            self._unwritten = f"{self.spec_dir}: {exc.strerror or exc}"
            self.log.error(
                "cannot write the CDI spec; Allocate is refused until it is written (at the next change)",
                dir=str(self.spec_dir),
                error=exc.strerror or str(exc),
            )
            return
        self._written = spec
        self._unwritten = None
        self.log.info("CDI spec written", path=str(self.spec_path), devices=len(entries))

    def _remove_spec(self) -> None:
        if self.spec_path is not None:
            try:
                self.spec_path.unlink()
                self.log.info("CDI spec removed", path=str(self.spec_path))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self.log.error(
                    "cannot remove the CDI spec", path=str(self.spec_path), error=exc.strerror or str(exc)
                )
        self._written = None

    # ------------------------------------------------------------------ the Backend contract
    def discover(self) -> list[Device]:
        devices = self.inner.discover()
        self._sync(devices)
        return devices

    async def watch(self) -> AsyncGenerator[list[Device], None]:
        if isinstance(self.inner, Watcher):
            async for devices in self.inner.watch():
                self._sync(devices)
                yield devices
        else:
            yield self.discover()

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return self._named(devices, self.inner.allocate(devices))

    def _named(self, devices: Sequence[Device], edits: ContainerEdits) -> ContainerEdits:
        """The inner backend's edits for ``devices``, less what the spec injects, plus the CDI names."""
        if self._unwritten is not None:
            raise BackendError(
                f"the CDI spec for {self.kind} could not be written ({self._unwritten}); the runtime could not "
                "resolve its device names"
            )
        missing = [d.id for d in devices if d.id not in self._per_device]
        if missing:
            raise BackendError(f"not in the CDI spec {self.spec_path}: {', '.join(missing)}")
        names = [qualified_name(self.kind, d.id) for d in devices]
        in_spec = [self._per_device[d.id] for d in devices]
        spec_mounts = {m.container_path for e in in_spec for m in e.mounts}
        spec_nodes = {n.container_path for e in in_spec for n in e.device_nodes}
        out = ContainerEdits(
            env=dict(edits.env),
            mounts=[m for m in edits.mounts if m.container_path not in spec_mounts],
            device_nodes=[n for n in edits.device_nodes if n.container_path not in spec_nodes],
            annotations=dict(edits.annotations),
            cdi_devices=[*edits.cdi_devices, *names],
        )
        if self.annotations:
            out.annotations[annotation_key("kxpu", self.resource)] = ",".join(names)
        return out

    def close(self) -> None:
        """Close the inner backend but keep the spec: the kubelet re-injects the checkpointed CDI names
        when a container restarts, also while the daemon is down or being upgraded, and those must
        still resolve. The next run rewrites the spec from discovery; vanished devices drop out then."""
        if isinstance(self.inner, Closable):
            self.inner.close()


class _Preferred:
    inner: Backend

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        assert isinstance(self.inner, PreferredAllocator)
        return self.inner.preferred_allocation(available, must_include, size)


class _PreStart:
    inner: Backend

    def pre_start(self, devices: Sequence[Device]) -> None:
        assert isinstance(self.inner, PreStarter)
        self.inner.pre_start(devices)


class _Shares:
    inner: Backend

    def allocate_shares(self, shares: Sequence[DeviceShare]) -> ContainerEdits:
        assert isinstance(self.inner, ShareAllocator) and isinstance(self, CdiBackend)
        return self._named([s.device for s in shares], self.inner.allocate_shares(shares))


class _Labels:
    inner: Backend

    def node_labels(self) -> dict[str, str]:
        assert isinstance(self.inner, NodeLabeller)
        return self.inner.node_labels()


_classes: dict[tuple[type, ...], type[CdiBackend]] = {}


def with_cdi(
    inner: Backend, resource: str, kind: str, spec_dir: Path, annotations: bool = False
) -> CdiBackend:
    """Wrap ``inner``, offering exactly the optional capabilities it offers (the daemon checks them)."""
    mixins = tuple(
        mixin
        for capability, mixin in (
            (PreferredAllocator, _Preferred),
            (PreStarter, _PreStart),
            (NodeLabeller, _Labels),
            (ShareAllocator, _Shares),
        )
        if isinstance(inner, capability)
    )
    cls = _classes.get(mixins)
    if cls is None:
        cls = type("CdiBackend", (*mixins, CdiBackend), {})
        _classes[mixins] = cls
    return cls(inner, resource, kind, spec_dir, annotations)
