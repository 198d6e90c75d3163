"""An op's bounded cache of call plans, with the plans a CUDA graph may need pinned."""
from __future__ import annotations

import collections
import os

class PlanCache:
    """An op's call plans by (M, layout): the `capacity` most recently used, and every pinned plan (made by
    `prepare` or used inside a CUDA-graph capture: a captured graph reads its tile order's device memory) on top.
    A mapping for the ops and the GPU checks: get, [key], [key] = plan (a pinned key stays pinned), clear (pins
    too), in, len."""

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"plan cache capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._pinned: dict = {}

    def get(self, key, default=None):
        if key in self._pinned:
            return self._pinned[key]
        plan = self._lru.get(key)
        if plan is None:
            return default
        self._lru.move_to_end(key)
        return plan

    def __getitem__(self, key):
        plan = self.get(key)
        if plan is None:
            raise KeyError(key)
        return plan

    def __setitem__(self, key, plan) -> None:
        if key in self._pinned:
            self._pinned[key] = plan
            return
        self._lru[key] = plan
        self._lru.move_to_end(key)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def pin(self, key) -> None:
        """Keep the plan of `key` (which must be cached) for the op's life."""
        if key not in self._pinned:
            self._pinned[key] = self._lru.pop(key)

    def pinned(self, key) -> bool:
        return key in self._pinned

    def clear(self) -> None:
        self._lru.clear()
        self._pinned.clear()

    def __contains__(self, key) -> bool:
        return key in self._pinned or key in self._lru

    def __len__(self) -> int:
        return len(self._pinned) + len(self._lru)


PLAN_CACHE_ENV = "FLUX_SHMEM_PLAN_CACHE"


def plan_cache_capacity() -> int:
    """Call plans an op keeps besides its pinned ones ($FLUX_SHMEM_PLAN_CACHE, default 256)."""
    v = os.environ.get(PLAN_CACHE_ENV, "256").strip()
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{PLAN_CACHE_ENV} must be a positive integer (plans kept per op), got {v!r}")
    return n
