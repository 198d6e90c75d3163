"""An op's bounded cache of call plans (and of the engines' device tables), with what a CUDA graph may need
pinned."""
from __future__ import annotations

import collections
import os


class PlanCache:
    """Plans (call plans, engine tables) by key: the `capacity` most recently used (the LRU), and every pinned one
    (made by `prepare` or used inside a CUDA-graph capture, which reads their device memory) on top.

    Every PE's cache must stay alike (a capture that misses on one PE only would record a call the others do not
    make), so what changes it depends only on what every PE does alike: `use` (a call: every PE calls with the same
    M) inserts or touches in the LRU, and `pin` (prepare, capture: collective too) keeps a plan for the op's life
    without touching the LRU; `peek` (a query, perhaps on one PE only: repr, path) changes nothing. A mapping for
    the ops and the GPU checks: peek, use, [key], [key] = plan, pin, pinned, clear (pins too), in, len."""

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"plan cache capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._pinned: dict = {}

    def peek(self, key, default=None):
        """The plan of `key`, or `default`, changing nothing."""
        if key in self._pinned:
            return self._pinned[key]
        return self._lru.get(key, default)

    def use(self, key, plan) -> None:
        """A call ran with `plan`: into the LRU as its most recent entry (the oldest beyond capacity leave)."""
        if key in self._pinned:
            self._pinned[key] = plan
        self._lru[key] = plan
        self._lru.move_to_end(key)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def entry(self, key, make, *, pin: bool = False, capturing: bool = False):
        """The plan of `key`, `make()` where there is none: what a call (pin False: it enters the LRU), prepare
        (pin True: pinned, the LRU as it is) and a call inside a capture (pinned too) use."""
        plan = self.peek(key)
        if plan is None:
            plan = make()
        if pin or capturing:
            self.pin(key, plan)
        if not pin:
            self.use(key, plan)
        return plan

    def __getitem__(self, key):
        plan = self.peek(key)
        if plan is None:
            raise KeyError(key)
        return plan

    def __setitem__(self, key, plan) -> None:
        self.use(key, plan)

    def pin(self, key, plan=None) -> None:
        """Keep the plan of `key` (`plan`, or the cached one) for the op's life; the LRU stays as it is."""
        plan = self.peek(key) if plan is None else plan
        if plan is None:
            raise KeyError(key)
        self._pinned[key] = plan

    def pinned(self, key) -> bool:
        return key in self._pinned

    def clear(self) -> None:
        self._lru.clear()
        self._pinned.clear()

    def __contains__(self, key) -> bool:
        return key in self._pinned or key in self._lru

    def __len__(self) -> int:
        return len(self._pinned.keys() | self._lru.keys())

    def state(self) -> tuple:
        """(LRU keys oldest first, pinned keys): what must be alike on every PE."""
        return tuple(self._lru), tuple(sorted(self._pinned))


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
