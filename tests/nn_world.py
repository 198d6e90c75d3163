"""A tensor-parallel world simulated in one process for the CPU tests: one thread per PE, collectives through
shared slots and a barrier. `ThreadRankBackend` is the flux_shmem.nn backend of one simulated PE (the stand-in
for the fused ops: the same math, exact on float64)."""
from __future__ import annotations

import threading
from typing import Callable

import torch


class ThreadWorld:
    def __init__(self, world: int, timeout_s: float = 60.0):
        self.world = world
        self._barrier = threading.Barrier(world, timeout=timeout_s)
        self._slots: list = [None] * world

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every PE's `t`, in rank order."""
        self._slots[rank] = t
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def run(self, fn: Callable[[int], object]) -> list:
        """fn(rank) on one thread per PE; their results in rank order (the first exception is raised)."""
        results: list = [None] * self.world
        errors: list = []

        def body(r: int) -> None:
            try:
                results[r] = fn(r)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self._barrier.abort()  # wake the others instead of letting them wait out the timeout

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class ThreadRankBackend:
    """flux_shmem.nn backend of PE `rank` in a ThreadWorld."""

    name = "threads"

    def __init__(self, world: ThreadWorld, rank: int):
        self.sim, self.rank, self.world_size = world, rank, world.world
        self.calls: list[tuple] = []

    def ag_gemm(self, a_shard, b, bias, return_gathered):
        self.calls.append(("ag_gemm", tuple(a_shard.shape), tuple(b.shape)))
        full = torch.cat(self.sim.exchange(self.rank, a_shard))
        out = full @ b
        if bias is not None:
            out = out + bias
        return out, (full if return_gathered else None)

    def gemm_rs(self, a, b, bias):
        self.calls.append(("gemm_rs", tuple(a.shape), tuple(b.shape)))
        parts = self.sim.exchange(self.rank, a @ b)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        rows = total.shape[0] // self.world_size
        out = total[self.rank * rows:(self.rank + 1) * rows].clone()
        return out if bias is None else out + bias
