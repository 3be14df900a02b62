"""Prepared claims on disk, so that a restarted driver neither loses nor duplicates them.

The kubelet may ask to prepare a claim again (it restarted, or its call timed out) and asks to
unprepare claims prepared by an earlier process of this driver, whose memory is gone; both must
work from what is on disk. One JSON file per driver, replaced atomically after every change::

    {"version": "v1", "driver": "npu.example.com",
     "claims": {"<claim UID>": {"namespace": "ns", "name": "c", "cdiSpec": "/var/run/cdi/….json",
                                "devices": [{"requests": ["npu"], "pool": "node-1", "device": "sim-0",
                                             "id": "sim-0", "cdiDeviceIDs": ["npu.example.com/claim=…"]}]}},
     "making": {"<claim UID>": {"claim": "ns/c", "devices": ["sim-0-1g-3"]}},
     "unreleased": [{…a partition's handle…}], "releasing": ["<claim UID>"]}

Written with ``atomicfile.write_atomically(durable=True)``: a new file, flushed, renamed into place and the rename
flushed, so a reader (the other pod of a rolling update, at its start) sees the old document or the new, whole.
Under the driver's checkpoint lock each write is also counted in the lock file (``kxpu.dra.instances``).

``making`` is written before the backend makes a claim's partitions and dropped once the claim is recorded
(or its partitions released): a partition the hardware holds that no claim owns is one a crash left behind,
and only those listed here (kxpu's own) are ever destroyed by the reconciliation. ``unreleased`` holds the
handles of partitions whose claim was unprepared while no backend could destroy them (the resource was no
longer configured): released as soon as a backend that can is back. ``releasing`` marks the claims whose
unprepare is destroying their partitions; a crash before their entry goes is finished at the next start.

A file that cannot be read or parsed is moved aside (``.corrupt``) with an error naming it, and the
driver starts with no prepared claims rather than not at all; the CDI specs already written stay in
place for the containers using them.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kxpu.atomicfile import write_atomically
from kxpu.dra.instances import HostLock
from kxpu.logs import get_logger

log = get_logger("kxpu.dra.checkpoint")

VERSION = "v1"
# Written compact: json's C encoder serves only calls without indent (the indenting one is pure Python, ten
# times slower, on a file that grows with the node's prepared claims).
_COMPACT = (",", ":")


class CheckpointError(Exception):
    """The checkpoint could not be written; the claim is not prepared (the kubelet retries)."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    requests: tuple[str, ...]
    pool: str
    device: str  # DRA device name
    id: str  # kxpu device ID
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    # A share's grant (consumable capacity): memory in MiB and compute in percent.
    memory_mib: int | None = None
    cores: int | None = None
    # A partition made for this claim (Partitioner.realize): what releasing it needs.
    partition: Mapping[str, str | int] | None = None
    # Allocated with adminAccess (monitoring beside the device's users): holds nothing of the device.
    admin_access: bool = False
    # The physical device a partition is cut from (its ``parent`` attribute), when it is not the device itself:
    # another path offering the physical device must not offer it while a part of it is prepared.
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    namespace: str
    name: str
    cdi_spec: str | None
    devices: tuple[PreparedDevice, ...] = field(default_factory=tuple)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def _device_to_json(d: PreparedDevice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": list(d.requests),
        "pool": d.pool,
        "device": d.device,
        "id": d.id,
        "cdiDeviceIDs": list(d.cdi_device_ids),
    }
    # The optional fields in this order, each only when set.
    if d.share_id:
        out["shareID"] = d.share_id
    if d.memory_mib is not None:
        out["memoryMiB"] = d.memory_mib
    if d.cores is not None:
        out["cores"] = d.cores
    if d.partition:
        out["partition"] = dict(d.partition)
    if d.admin_access:
        out["adminAccess"] = True
    if d.parent:
        out["parent"] = d.parent
    return out


def _claim_to_json(claim: PreparedClaim) -> dict[str, Any]:
    return {
        "namespace": claim.namespace,
        "name": claim.name,
        "cdiSpec": claim.cdi_spec,
        "devices": [_device_to_json(d) for d in claim.devices],
    }


def _claim_from_json(raw: Mapping[str, Any]) -> PreparedClaim:
    return PreparedClaim(
        namespace=str(raw["namespace"]),
        name=str(raw["name"]),
        cdi_spec=raw.get("cdiSpec"),
        devices=tuple(
            PreparedDevice(
                requests=tuple(str(r) for r in d["requests"]),
                pool=str(d["pool"]),
                device=str(d["device"]),
                id=str(d["id"]),
                cdi_device_ids=tuple(str(c) for c in d["cdiDeviceIDs"]),
                share_id=d.get("shareID"),
                memory_mib=d.get("memoryMiB"),
                cores=d.get("cores"),
                partition=d.get("partition"),
                admin_access=bool(d.get("adminAccess", False)),
                parent=d.get("parent"),
            )
            for d in raw["devices"]
        ),
    )


@dataclass(frozen=True, slots=True)
class Making:
    """Partitions about to be made for a claim (written ahead of ``Partitioner.realize``)."""

    claim: str  # namespace/name, for logs
    devices: tuple[str, ...]  # kxpu device IDs


_State = tuple[dict[str, PreparedClaim], dict[str, Making], list[dict[str, str | int]], list[str]]


@dataclass(frozen=True, slots=True)
class _Update:
    """A checkpoint file another process wrote, read and parsed: what ``Checkpoint.take`` applies."""

    state: _State
    seen: tuple[int, int, int, int]
    count: int | None


class _Exclusive:
    """``Checkpoint.exclusive()``: a plain object rather than a generator-based context manager (two nested ones
    cost a prepare more than the lock itself)."""

    __slots__ = ("checkpoint",)

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint

    async def __aenter__(self) -> bool:
        checkpoint, lock = self.checkpoint, self.checkpoint.lock
        if not lock.try_acquire():
            await lock.acquire()
        try:
            # A stat and a read of 8 bytes on the loop (microseconds; a worker thread costs a prepare's latency):
            # the file is read in a thread only when another process replaced it.
            count = lock.count()
            if count != checkpoint._count or _identity(checkpoint.path) != checkpoint._seen:
                # Read and parsed in a thread, taken on the loop while the lock is held: a call cancelled meanwhile
                # (the kubelet's deadline) releases the lock, and the thread's late result must then change nothing.
                update = await asyncio.to_thread(checkpoint.read_changed, count)
                return update is not None and checkpoint.take(update)
            return False
        except BaseException:
            lock.release()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self.checkpoint.lock.release()


class Checkpoint:
    """The prepared claims of one driver (claim UID → PreparedClaim), mirrored to ``path``."""

    def __init__(self, path: Path, driver: str) -> None:
        self.path = path
        self.driver = driver
        self.claims: dict[str, PreparedClaim] = {}
        self.making: dict[str, Making] = {}
        self.unreleased: list[dict[str, str | int]] = []
        self.releasing: list[str] = []  # claim UIDs whose unprepare is destroying their partitions
        self.set_aside = False  # the file on disk was unusable at load and moved away
        # Another process of this driver (a rolling update's other pod) may change the file between our calls:
        # each call takes this lock and reloads what changed (kxpu.dra.instances).
        self.lock = HostLock(path.with_name(f"{path.name}.lock"))
        self._seen: tuple[int, int, int, int] | None = (
            None  # the file as last loaded or written (inode, mtime, size)
        )
        # The writes counted in the lock file when this process last loaded or wrote the file: two writes by another
        # process within one tick of the file clock, of the same size, onto a reused inode number, would leave
        # inode, time and size as they were; the count does not.
        self._count: int | None = None
        # Each claim's JSON as last written (``"<uid>":{…}``), by UID: a claim's record never changes once made (PreparedClaim is
        # frozen; a changed claim is a new object), so a save serialises only the claims added since the last one,
        # not every claim prepared on the node.
        self._encoded: dict[str, tuple[PreparedClaim, str]] = {}
        self._name = str(path)
        self._head = _dumps({"version": VERSION, "driver": driver})[:-1]

    def exclusive(self) -> _Exclusive:
        """Hold the driver's checkpoint lock (``async with``); the file is reloaded first if another process wrote
        it since this one last did (entering gives whether it was)."""
        return _Exclusive(self)

    def refresh(self, count: int | None = None) -> bool:
        """Load the file again if another process of the driver replaced it since this object last loaded or
        wrote it (or wrote ``count``, the lock file's count of writes, differing from this process's); True if it
        did. A file that cannot be read now is left where it is (it was good at start, and only kxpu writes it)
        and what this process holds is kept: the error is logged, the call goes on."""
        update = self.read_changed(count)
        return update is not None and self.take(update)

    def read_changed(self, count: int | None = None) -> _Update | None:
        """``refresh``'s reading half, changing nothing here (safe in a worker thread): the file's state if it
        changed, else None."""
        seen = _identity(self.path)
        if seen is None or not stat.S_ISREG(seen[3]):
            return None  # removed or replaced by something no kxpu writes: nothing to reload
        if seen == self._seen and (count is None or count == self._count):
            return None  # unchanged
        try:
            state = self._parse(json.loads(self.path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error(
                "cannot reload the DRA checkpoint another process of this driver wrote; keeping this process's",
                path=str(self.path),
                reason=f"{type(exc).__name__}: {exc}",
            )
            return None
        return _Update(state, seen, count)

    def take(self, update: _Update) -> bool:
        """``refresh``'s applying half (on the loop, the lock held)."""
        self.claims, self.making, self.unreleased, self.releasing = update.state
        self._seen = update.seen
        if update.count is not None:
            self._count = update.count
        return True

    def load(self) -> None:
        self._count = self.lock.peek_count()  # before the file: a write meanwhile shows as a newer count
        self._seen = _identity(self.path)
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            self.claims, self.making, self.unreleased, self.releasing = {}, {}, [], []
            return
        except OSError as exc:
            self._move_aside(f"unreadable: {exc.strerror or exc}")
            return
        try:
            self._apply(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._move_aside(f"not a kxpu {VERSION} checkpoint of {self.driver}: {type(exc).__name__}: {exc}")

    def _apply(self, raw: Any) -> None:
        """The parsed file's claims become this object's (all or nothing: raises before changing anything)."""
        self.claims, self.making, self.unreleased, self.releasing = self._parse(raw)

    def _parse(self, raw: Any) -> _State:
        """The file's claims, partitions being made, unreleased holds and releasing claims (raises if not ours)."""
        if raw.get("version") != VERSION or raw.get("driver") != self.driver:
            raise ValueError(f"version {raw.get('version')!r}, driver {raw.get('driver')!r}")
        claims = {str(uid): _claim_from_json(c) for uid, c in raw["claims"].items()}
        making = {
            str(uid): Making(str(m["claim"]), tuple(str(d) for d in m["devices"]))
            for uid, m in (raw.get("making") or {}).items()
        }
        unreleased = [dict(h) for h in raw.get("unreleased") or []]
        releasing = [str(u) for u in raw.get("releasing") or []]
        return claims, making, unreleased, releasing

    def _move_aside(self, why: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        try:
            os.replace(self.path, aside)
        except OSError:
            aside = self.path
        self.set_aside = True
        log.error(
            "DRA checkpoint unusable; starting with no prepared claims (CDI specs already written stay)",
            path=str(self.path),
            moved_to=str(aside),
            reason=why,
        )
        self.claims, self.making, self.unreleased, self.releasing = {}, {}, [], []
        self._seen = _identity(self.path)

    def save(self) -> None:
        self._encoded = encoded = {
            uid: known
            if (known := self._encoded.get(uid)) is not None and known[0] is claim
            else (claim, f"{_dumps(uid)}:{_dumps(_claim_to_json(claim))}")
            for uid, claim in sorted(self.claims.items())
        }
        claims = ",".join(text for _, text in encoded.values())
        rest = {
            **(
                {
                    "making": {
                        uid: {"claim": m.claim, "devices": list(m.devices)}
                        for uid, m in sorted(self.making.items())
                    }
                }
                if self.making
                else {}
            ),
            **({"unreleased": [dict(h) for h in self.unreleased]} if self.unreleased else {}),
            **({"releasing": list(self.releasing)} if self.releasing else {}),
        }
        # The same text json.dumps gives for the whole document, its keys in this order.
        tail = f",{_dumps(rest)[1:]}" if rest else "}"
        text = f'{self._head},"claims":{{{claims}}}{tail}\n'
        try:
            if self.lock.held:
                # Counted first: a count without its write costs another process one needless reload at most.
                count = self.lock.count() + 1
                self.lock.set_count(count)
                self._count = count
            written = write_atomically(self._name, text, mode=0o600, durable=True)
            self._seen = (written.st_ino, written.st_mtime_ns, written.st_size, written.st_mode)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write the DRA checkpoint {self.path}: {exc.strerror or exc}"
            ) from None

    def holders_of(self, device: str) -> list[tuple[str, PreparedClaim, PreparedDevice]]:
        """Every (claim UID, claim, prepared device) that holds ``device``, whole or a share of it."""
        return [
            (uid, claim, prepared)
            for uid, claim in self.claims.items()
            for prepared in claim.devices
            if prepared.device == device
        ]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=_COMPACT)


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)


def held_devices(claims: Mapping[str, PreparedClaim]) -> dict[str, str]:
    """Every device these claims hold (kxpu ID, and the physical device a partition is cut from) → the
    claim holding it: what no other path may offer while they are prepared. Admin access holds nothing."""
    out: dict[str, str] = {}
    for claim in claims.values():
        for d in claim.devices:
            if d.admin_access:
                continue
            out.setdefault(d.id, claim.ref)
            if d.parent:
                out.setdefault(d.parent, claim.ref)
    return out


def as_dict(claim: PreparedClaim) -> dict[str, Any]:
    """For logs and ``kxpu status``."""
    return asdict(claim)
