"""Queued and prefilling requests by how their prompts start, so that routing a new
request compares it with the few that start like it instead of scanning every
worker's queue (which made a burst of N requests cost O(N²): 4,096 at once over
64 workers took 15 s of scheduler CPU to place).

    (cache_salt, prompt[:min_tokens]) ──▶ [r17, r40, r41]   most recent last, at most PER_KEY

An entry is checked when read: a request counts while it is still the book's and
pending or prefilling, on the worker it is on now (failover moves requests). Keys
whose requests have all moved on are swept every SWEEP_EVERY additions, so the map
holds about the live requests' keys."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from services.scheduler.core.state import RequestState

PER_KEY = 256
SWEEP_EVERY = 4096

Key = tuple[str, tuple[int, ...]]


class RecentPrefixes:
    def __init__(self, min_tokens: int, is_live: Callable[[RequestState], bool]) -> None:
        self._min_tokens = min_tokens
        self._is_live = is_live
        self._by_key: dict[Key, deque[RequestState]] = {}
        self._added = 0

    def _key(self, prompt: tuple[int, ...], cache_salt: str) -> Key | None:
        if self._min_tokens <= 0 or len(prompt) < self._min_tokens:
            return None
        return cache_salt, prompt[:self._min_tokens]

    def add(self, request: RequestState) -> None:
        """A request just queued on its worker."""
        key = self._key(request.prompt, request.spec.cache_salt)
        if key is None:
            return
        self._by_key.setdefault(key, deque(maxlen=PER_KEY)).append(request)
        self._added += 1
        if self._added % SWEEP_EVERY == 0:
            self.sweep()

    def candidates(self, prompt: tuple[int, ...], cache_salt: str) -> list[RequestState]:
        """The live requests whose prompts start like `prompt` under `cache_salt`, most
        recent first."""
        key = self._key(prompt, cache_salt)
        entries = self._by_key.get(key) if key is not None else None
        if not entries:
            return []
        return [request for request in reversed(entries) if self._is_live(request)]

    def sweep(self) -> None:
        """Drops the requests that moved on, and the keys left empty."""
        for key in list(self._by_key):
            live = [request for request in self._by_key[key] if self._is_live(request)]
            if live:
                self._by_key[key] = deque(live, maxlen=PER_KEY)
            else:
                del self._by_key[key]

    def __len__(self) -> int:
        return len(self._by_key)
