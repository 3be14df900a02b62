"""kxpu.kube.watch: the one loop that keeps every watch of API objects going (the extender's caches, the
DRA driver's claim cache and slice watch). What it promises: a failed round is said once, in the caller's
words, and retried after a backoff that doubles to its cap and starts over once a watch delivers again; a
round that ended cleanly starts again after the pause; ``after`` runs after every round, cancelled included;
``list_then_watch`` replaces a cache with a fresh list, then follows the watch from where the list ended."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from kxpu.kube import watch
from kxpu.kube.watch import keep_watching, list_then_watch, list_version


class Refused(Exception):
    pass


async def test_failures_back_off_doubling_to_the_cap_and_start_over_once_a_watch_delivers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watch, "BACKOFF_S", 0.01)
    monkeypatch.setattr(watch, "BACKOFF_MAX_S", 0.04)
    # Each round: how many events it delivers before it fails.
    script = [0, 0, 0, 0, 2, 0]
    said: list[tuple[str, float]] = []
    rounds = 0
    done = asyncio.Event()

    async def watch_round(delivered: Callable[[], None]) -> None:
        nonlocal rounds
        if rounds == len(script):
            done.set()
            await asyncio.Event().wait()  # a watch that stays open
        events = script[rounds]
        rounds += 1
        for _ in range(events):
            delivered()
        raise Refused("the server said no")

    task = asyncio.create_task(keep_watching(watch_round, lambda error, retry: said.append((error, retry))))
    try:
        await asyncio.wait_for(done.wait(), 5)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [retry for _, retry in said] == [0.01, 0.02, 0.04, 0.04, 0.01, 0.02]
    assert {error for error, _ in said} == {"Refused: the server said no"}


async def test_a_round_that_ends_cleanly_is_no_failure_and_after_runs_each_round_and_on_cancel() -> None:
    said: list[tuple[str, float]] = []
    afters = 0
    rounds = 0
    third = asyncio.Event()

    async def watch_round(delivered: Callable[[], None]) -> None:
        nonlocal rounds
        rounds += 1
        if rounds == 3:
            third.set()
            await asyncio.Event().wait()

    def after() -> None:
        nonlocal afters
        afters += 1

    task = asyncio.create_task(
        keep_watching(watch_round, lambda error, retry: said.append((error, retry)), after=after, pause_s=0.0)
    )
    await asyncio.wait_for(third.wait(), 5)
    assert afters == 2 and said == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert afters == 3  # the cancelled round too: a cache stops answering once its watch is gone


def test_list_version_is_where_the_list_ended_or_none() -> None:
    class Listed:
        resourceVersion = 42

    class NotReady:
        @property
        def resourceVersion(self) -> str:
            raise RuntimeError("no page came back")

    assert list_version(Listed()) == "42"
    assert list_version(NotReady()) is None


class Listing:
    """lightkube's list: an async iterable whose resourceVersion is known once it is exhausted."""

    def __init__(self, objects: list[str], version: str) -> None:
        self.objects, self.version, self.done = objects, version, False

    def __aiter__(self) -> Any:
        return self._each()

    async def _each(self) -> Any:
        for obj in self.objects:
            yield obj
        self.done = True

    @property
    def resourceVersion(self) -> str:
        if not self.done:
            raise RuntimeError("not ready")
        return self.version


class Client:
    def __init__(self, listed: list[str], events: list[tuple[str, str]]) -> None:
        self.listed, self.events = listed, events
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def list(self, resource: Any, **selector: Any) -> Listing:
        self.calls.append(("list", resource, selector))
        return Listing(self.listed, "7")

    async def watch(self, resource: Any, **selector: Any) -> Any:
        self.calls.append(("watch", resource, selector))
        for event in self.events:
            yield event


async def test_a_round_replaces_the_cache_with_the_list_then_follows_the_watch_from_where_it_ended() -> None:
    cache = {"gone": "old", "a": "old"}
    order: list[str] = []
    delivered: list[None] = []

    def put(obj: str) -> str | None:
        if obj == "ignored":
            return None
        cache[obj] = "put"
        return obj

    def keep_only(seen: set[str]) -> None:
        order.append("keep_only")
        for key in set(cache) - seen:
            del cache[key]

    client = Client(["a", "b", "ignored"], [("ADDED", "c"), ("DELETED", "a"), ("MODIFIED", "b")])
    await list_then_watch(
        client,
        str,
        {"labels": {"x": "y"}},
        put=put,
        drop=lambda obj: cache.pop(obj),
        keep_only=keep_only,
        synced=lambda: order.append(f"synced with {sorted(cache)}"),
        delivered=lambda: delivered.append(None),
    )
    assert order == ["keep_only", "synced with ['a', 'b']"]  # "gone" went: the list replaced the cache
    assert cache == {"b": "put", "c": "put"}
    assert len(delivered) == 3
    assert client.calls == [
        ("list", str, {"labels": {"x": "y"}}),
        ("watch", str, {"labels": {"x": "y"}, "resource_version": "7"}),
    ]
