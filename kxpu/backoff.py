"""Exponential backoff for retries that must not hammer the kubelet or the API server nor wait too long."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Backoff:
    initial: float = 0.2
    maximum: float = 10.0
    factor: float = 2.0
    _next: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._next = self.initial

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._next * self.factor, self.maximum)
        return delay

    def reset(self) -> None:
        self._next = self.initial
