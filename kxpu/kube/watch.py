"""Keeping a watch going: the one loop every follower of API objects runs (the extender's node, pod and
Lease caches; the DRA driver's claim cache and its ResourceSlice watch).

Each round lists where its cache needs a fresh base, then watches from that list's resourceVersion until the
watch ends. Whatever ends a round, the next one begins: a watch that simply ended, after ``pause_s``; a
round that failed (410 Gone once the version is too old, a dropped connection, the API server's refusal),
after a backoff of ``BACKOFF_S`` doubling to ``BACKOFF_MAX_S``, back to the start once a watch delivers an
event again. A failure is said once a round, in the caller's words, with ``error=Type: message``.

``list_then_watch`` is the usual round over a lightkube client: list into a cache, keep only what the list
brought, then apply each watch event. Free of lightkube itself: the rounds make their own calls (the DRA
driver loads the client on its first one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any, NoReturn, TypeVar

from kxpu.backoff import Backoff
from kxpu.logs import error_text

K = TypeVar("K", bound=Hashable)

BACKOFF_S = 0.5
BACKOFF_MAX_S = 30.0


async def keep_watching(
    watch_round: Callable[[Callable[[], None]], Awaitable[None]],
    failed: Callable[[str, float], None],
    *,
    after: Callable[[], None] = lambda: None,
    pause_s: float = 0.0,
) -> NoReturn:
    """Run ``watch_round(delivered)`` again and again until cancelled.

    The round calls ``delivered()`` for each watch event (the backoff starts over); ``failed(error, retry_in_s)``
    says why a round failed; ``after()`` runs once each round is over, cancelled included (a cache stops
    answering until its next list has ended).
    """
    backoff = Backoff(initial=BACKOFF_S, maximum=BACKOFF_MAX_S)
    while True:
        try:
            await watch_round(backoff.reset)
            delay = pause_s
        except asyncio.CancelledError:
            after()
            raise
        except Exception as exc:  # the API server's answer or the connection's failure: retried
            delay = backoff.next_delay()
            failed(error_text(exc), round(delay, 2))
        after()
        await asyncio.sleep(delay)


def list_version(listing: Any) -> str | None:
    """The resourceVersion a finished list ended at, to watch from exactly there (None: no page came back,
    lightkube's NotReadyError; the watch then starts from now)."""
    try:
        return str(listing.resourceVersion)
    except Exception:
        return None


async def list_then_watch(
    client: Any,
    resource: type,
    selector: Mapping[str, Any],
    *,
    put: Callable[[Any], K | None],
    drop: Callable[[Any], object],
    keep_only: Callable[[set[K]], object],
    synced: Callable[[], None],
    delivered: Callable[[], None],
) -> None:
    """One round of a cache of ``resource`` objects (``selector``: list and watch arguments, e.g. labels):
    ``put`` each listed object (its key in the cache; None: not kept), ``keep_only`` the keys the list
    brought (a fresh list *replaces* the cache: what went meanwhile goes), ``synced``, then from where the
    list ended ``put`` each added or modified object and ``drop`` each deleted one until the watch ends."""
    listing = client.list(resource, **selector)
    seen: set[K] = set()
    async for obj in listing:
        key = put(obj)
        if key is not None:
            seen.add(key)
    keep_only(seen)
    synced()
    async for event, obj in client.watch(resource, resource_version=list_version(listing), **selector):
        delivered()
        if event == "DELETED":
            drop(obj)
        else:
            put(obj)
