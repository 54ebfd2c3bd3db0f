"""Single-use, expiring tokens for streaming URLs (the streaming server owns them).

A token is 32 random bytes (URL-safe base64); it is taken out of the cache on first use, so a
second use, like an expired or unknown token, finds nothing. The cache is bounded: when full,
the oldest pending token is dropped (containerd's ``requestCache`` does the same).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TokenCache(Generic[T]):
    def __init__(self, ttl_s: float, capacity: int = 1000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, T]] = OrderedDict()

    def _expire(self, now: float) -> None:
        while self._items:
            token, (deadline, _) = next(iter(self._items.items()))
            if deadline > now and len(self._items) <= self.capacity:
                return
            del self._items[token]

    def put(self, request: T) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            now = self._clock()
            self._items[token] = (now + self.ttl_s, request)
            self._expire(now)
        return token

    def take(self, token: str) -> T | None:
        """The request stored under ``token``, once; None when unknown, used or expired."""
        with self._lock:
            self._expire(self._clock())
            item = self._items.pop(token, None)
        return None if item is None else item[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
