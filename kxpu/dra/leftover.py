"""DRA drivers whose claims are still prepared on this node though the config no longer serves them through DRA.

The resource left the config, is served through the device plugin now, or its driver was renamed, and the
daemon restarted (a reload refuses such a change while claims are prepared; a restart cannot refuse to
start). The claims' containers still run, and their devices are theirs until the kubelet unprepares them:

- each such driver keeps its DRA socket and registration up and serves **only unprepare** (prepare of a
  new claim is refused with one line; a claim prepared before gets its old answer, as the kubelet asks again
  after it restarts), publishes no device (its ResourceSlices are withdrawn), and stops once its last claim is
  released: otherwise a deleted pod stays ``Terminating`` and its CDI spec stays behind;
- the devices its claims hold are never offered through another path meanwhile: a resource served through the
  device plugin offers them as Unhealthy, with the holding claim as the reason (``withheld``), and offers them
  again the moment the claims are released. Unhealthy rather than left out: the kubelet keeps them in the node's
  capacity but not in its allocatable, admits no pod to them, and ``kxpu status`` shows why;
- the daemon says so in one line per driver, and ``/status`` lists the claims (``kxpu status`` shows them).

Read at start, before any resource is offered, from ``<kubeletPluginsDir>/<driver>/checkpoint.json``: only files
that are a kxpu checkpoint of that driver (another DRA driver's file of the same name is never touched).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kxpu.config import Config, ResourceConfig
from kxpu.dra.checkpoint import VERSION, held_devices
from kxpu.dra.config import driver_sockets
from kxpu.logs import error_text, get_logger
from kxpu.model import Backend, BackendError, ContainerEdits, Device
from kxpu.sockets import live_socket

log = get_logger("kxpu.dra.leftover")

CHECKPOINT = "checkpoint.json"


def find_leftovers(plugins_dir: Path, served: set[str]) -> list[str]:
    """The drivers under ``plugins_dir`` with claims in a kxpu checkpoint that are not in ``served`` and that no
    other live process serves."""
    try:
        entries = sorted(plugins_dir.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        driver = entry.name
        if driver in served or any(live_socket(p) for p in driver_sockets(plugins_dir, driver)):
            continue  # served here, or by another live process (a second daemon, an update's other pod)
        try:
            raw = json.loads((entry / CHECKPOINT).read_text())
        except (OSError, ValueError):
            continue
        if (
            isinstance(raw, dict)
            and raw.get("version") == VERSION
            and raw.get("driver") == driver
            and isinstance(raw.get("claims"), dict)
            and raw["claims"]
        ):
            out.append(driver)
    return out


def leftovers_for(
    config: Config, node: str, make: Callable[[str, ResourceConfig | None], DrainingPlugin]
) -> Leftovers | None:
    """The draining drivers of ``config`` (``make`` builds each one's plugin from the resource now configured
    with its driver name, if any); None when there are none. Raises ValueError when one has no node name."""
    served = {r.dra_driver for r in config.resources if r.serve == "dra"}
    drivers = find_leftovers(config.kubelet_plugins_dir, served)
    if not drivers:
        return None
    by_driver: dict[str, ResourceConfig] = {}
    for resource in config.resources:
        with contextlib.suppress(ValueError):  # a device-plugin resource whose name gives no driver name
            by_driver.setdefault(resource.dra_driver, resource)
    unnamed = [d for d in drivers if not node and not (d in by_driver and by_driver[d].dra.node_name)]
    if unnamed:
        raise ValueError(
            f"DRA claims are still prepared for driver(s) {', '.join(unnamed)}, which this config no longer serves "
            "through DRA; unpreparing them needs the node name ($NODE_NAME)"
        )
    return Leftovers(
        {d: by_driver[d].name if d in by_driver else None for d in drivers},
        lambda driver, _resource: make(driver, by_driver.get(driver)),
    )


class NoDevices(Backend):
    """The backend of a draining driver: it offers nothing (its resource is not served through DRA)."""

    def discover(self) -> list[Device]:
        return []

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        raise BackendError("this DRA driver is no longer served on this node")


class DrainingPlugin(Protocol):
    """What a draining driver needs of ``kxpu.dra.plugin.DraPlugin``."""

    @property
    def preparer(self) -> Any: ...

    async def run(self) -> None: ...

    async def withdraw(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass
class _Draining:
    driver: str
    resource: str | None  # the resource of the current config whose driver this is, if any
    plugin: DrainingPlugin
    task: asyncio.Task[None] | None = None
    done: bool = False
    claims: dict[str, Any] = field(default_factory=dict)


class Leftovers:
    """The draining drivers of this daemon: serve them, tell the device plugin what they hold, report them."""

    def __init__(
        self, drivers: Mapping[str, str | None], make: Callable[[str, str | None], DrainingPlugin]
    ) -> None:
        """``drivers``: driver → the resource now configured with that driver name (or None); ``make`` builds
        the driver's plugin (its checkpoint is loaded here, at once, so ``withheld`` is right from the start)."""
        self._drivers: dict[str, _Draining] = {}
        for driver, resource in drivers.items():
            plugin = make(driver, resource)
            plugin.preparer.draining = True
            plugin.preparer.checkpoint.load()
            self._drivers[driver] = _Draining(driver, resource, plugin)
        self.version = 0
        self._changed = asyncio.Condition()

    def __bool__(self) -> bool:
        return any(not d.done for d in self._drivers.values())

    def withheld(self, driver: str) -> dict[str, str]:
        """Device ID (or UUID, or physical device) → why it must not be offered: a claim of ``driver`` that the
        config no longer serves through DRA still holds it."""
        draining = self._drivers.get(driver)
        if draining is None or draining.done:
            return {}
        return {
            device: f"held by DRA claim {claim} of driver {driver} (no longer served through DRA)"
            for device, claim in held_devices(draining.plugin.preparer.checkpoint.claims).items()
        }

    def withheld_from(self, resource: str) -> dict[str, str]:
        """What a DRA driver serving ``resource`` must not prepare: the devices held by draining drivers of that
        resource or of none now configured (a driver renamed or removed; matched by device ID, which errs on the
        safe side)."""
        out: dict[str, str] = {}
        for d in list(self._drivers.values()):
            if d.resource in (None, resource):
                out.update(self.withheld(d.driver))
        return out

    async def wait_newer_than(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version > version)

    async def _bump(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def run(self) -> None:
        """Serve every draining driver until its last claim is released; then withdraw its slices and stop it."""
        for d in self._drivers.values():
            checkpoint = d.plugin.preparer.checkpoint
            log.warning(
                "DRA claims are still prepared for a driver this config no longer serves through DRA: serving only "
                "their unprepare; the devices they hold are not offered elsewhere until they are released",
                driver=d.driver,
                resource=d.resource,
                claims=sorted(c.ref for c in checkpoint.claims.values()),
                devices=sorted(held_devices(checkpoint.claims)),
            )
        if not self._drivers:
            return
        try:
            async with asyncio.TaskGroup() as tasks:
                for d in self._drivers.values():
                    tasks.create_task(self._drain(d))
        finally:
            for d in self._drivers.values():
                await self._stop(d)

    async def _drain(self, d: _Draining) -> None:
        preparer = d.plugin.preparer
        d.task = asyncio.create_task(d.plugin.run(), name=f"draining DRA driver {d.driver}")
        try:
            while preparer.checkpoint.claims:
                preparer.changed.clear()
                waiting = asyncio.ensure_future(preparer.changed.wait())
                await asyncio.wait([waiting, d.task], return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                await self._bump()  # claims were released: the device plugin may offer their devices again
                if d.task.done():
                    exc = None if d.task.cancelled() else d.task.exception()
                    log.error(
                        "the draining DRA driver stopped; its claims are left",
                        driver=d.driver,
                        error=error_text(exc) if exc else "cancelled",
                    )
                    return
            d.done = True
            await self._stop(d)
            try:
                await d.plugin.withdraw()
            except Exception as exc:
                log.error("cannot withdraw the ResourceSlices of a drained driver", error=error_text(exc))
            log.info(
                "every claim of the draining DRA driver is released; it is no longer served", driver=d.driver
            )
        finally:
            await self._bump()

    async def _stop(self, d: _Draining) -> None:
        if d.task is not None and not d.task.done():
            d.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await d.task

    async def hand_over(self, drivers: set[str]) -> None:
        """These drivers are served through DRA again (a reload): the draining one steps aside, and the new
        DRA server takes its checkpoint over (it loads it from disk)."""
        for driver in drivers:
            d = self._drivers.get(driver)
            if d is not None and not d.done:
                d.done = True
                await self._stop(d)
                log.info(
                    "a draining DRA driver is served through DRA again; handing its claims over",
                    driver=driver,
                )
        await self._bump()

    def describe(self) -> dict[str, Any]:
        """For /status (read from the HTTP thread: plain reads only)."""
        return {
            d.driver: {
                "resource": d.resource,
                "note": "no longer served through DRA: unprepare only, until its claims are released",
                "claims": d.plugin.describe().get("claims", {}),
            }
            for d in list(self._drivers.values())
            if not d.done
        }
