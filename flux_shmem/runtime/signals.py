"""Signals: per-op synchronisation state, flux_shmem's own barrier, signal pools, and device error reports.

NVSHMEM's team barriers are refused when several PEs share a GPU ("limited MPG"), so the barrier here is made of
put/signal operations that work in every mode. Device-side waits that time out write an ErrorRecord into pinned
host memory; `check_errors()` turns it into a SignalTimeoutError and a watchdog thread prints it as soon as it
appears, even while the CUDA context is dead after a trap.
"""
from __future__ import annotations

import atexit
import ctypes
import sys
import threading

import torch

from ..errors import SignalTimeoutError
from ..kernels import abi
from ..kernels.module import load
from . import symmetric
from .state import Runtime, get_runtime


class ErrorChannel:
    """One per process: the device-memory claim word and the host-mapped record it guards."""

    def __init__(self, rt: Runtime):
        words = ctypes.sizeof(abi.ErrorRecord) // 8
        self.record = torch.zeros(words, dtype=torch.int64, pin_memory=True)  # UVA: the device writes it directly
        self.slot = torch.zeros(2, dtype=torch.int64, device=f"cuda:{rt.device}")
        self.slot[1] = self.record.data_ptr()
        torch.cuda.synchronize()
        self._timeout_s = rt.timeout_s
        # Made once (the runtime's settings are fixed for the channel's life): every kernel launch takes it.
        self._ctx = abi.Ctx(err=self.slot.data_ptr(), timeout_ns=int(rt.timeout_s * 1e9), my_pe=rt.rank,
                            n_pes=rt.world_size, trap_on_timeout=int(rt.trap_on_timeout))
        self._stop = threading.Event()
        self._reported = False
        self._thread = threading.Thread(target=self._watch, name="flux_shmem-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self._report)  # a process dying right after a trap still says why

    def ctx(self) -> abi.Ctx:
        return self._ctx  # callers copy it into their argument structs (ctypes copies struct fields)

    def read(self) -> abi.ErrorRecord | None:
        rec = abi.ErrorRecord.from_address(self.record.data_ptr())
        return abi.ErrorRecord.from_buffer_copy(rec) if rec.flag == 1 else None

    def message(self, rec: abi.ErrorRecord) -> str:
        what = abi.SITES.get(rec.site, f"site {rec.site}")
        seen = rec.seen - (1 << 64) if rec.seen >= 1 << 63 else rec.seen  # (a negative lock read as 64 bits)
        return (f"flux_shmem: PE {rec.pe} timed out after {self._timeout_s:g} s waiting on {what} {rec.index}: "
                f"needed >= {rec.expected}, saw {seen} (signal at 0x{rec.addr:x}, block {rec.block}, thread "
                f"{rec.thread}). A peer did not arrive or stopped early: check every PE made the same calls; "
                "raise FLUX_SHMEM_TIMEOUT_S if the wait was legitimately long." + abi.HINTS.get(rec.site, ""))

    def _report(self) -> bool:
        rec = self.read()
        if rec is not None and not self._reported:
            self._reported = True
            print(self.message(rec), file=sys.stderr, flush=True)
        return rec is not None

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            if self._report():
                return

    def close(self) -> None:
        self._stop.set()


def check_errors() -> None:
    """Raise SignalTimeoutError if any device-side wait of this process timed out. Costs one host memory read."""
    ch: ErrorChannel = get_runtime()._internal["errors"]
    rec = ch.read()
    if rec is not None:
        raise SignalTimeoutError(ch.message(rec))


def ctx() -> abi.Ctx:
    """The timeout/error context every kernel takes."""
    return get_runtime()._internal["errors"].ctx()


class SyncState:
    """Per-op state: arrival slots (symmetric, one per PE) and a device-side epoch counter.

    The epoch is 1 on the first call and bumped on the stream at the end of each call, so signals compare against
    a value that only grows: no resets, and CUDA graphs replay correctly.
    """

    def __init__(self, rt: Runtime | None = None):
        rt = rt or get_runtime()
        self.bar = symmetric.zeros((rt.world_size,), torch.int64)
        self.epoch = torch.ones(1, dtype=torch.int64, device=f"cuda:{rt.device}")

    def barrier(self, stream=None) -> None:
        """Arrive in this state's current epoch and wait for every PE's arrival (no bump: the caller's call ends
        with one). One block, one thread per PE."""
        rt = get_runtime()
        args = abi.BarrierArgs(ctx=ctx(), bar=self.bar.data_ptr(), epoch=self.epoch.data_ptr(),
                               node_size=rt.node_size)
        threads = min(1024, max(32, (rt.world_size + 31) // 32 * 32))
        load("collectives").kernel("fs_barrier").launch(args, 1, threads, stream=stream)

    def bump(self, stream=None) -> None:
        load("collectives").kernel("fs_epoch_bump").launch(abi.EpochArgs(self.epoch.data_ptr()), 1, 1,
                                                           stream=stream)


def barrier(stream=None) -> None:
    """Block `stream` (default: torch's current stream) until every PE's stream has reached its barrier.

    Collective, asynchronous for the host, works when PEs share a GPU; waits time out (FLUX_SHMEM_TIMEOUT_S).
    """
    check_errors()
    sync: SyncState = get_runtime()._internal["barrier"]
    sync.barrier(stream)
    sync.bump(stream)


class SignalPool:
    """`n` uint64 signal words on every PE (symmetric), for kernels that synchronise on them. Collective."""

    def __init__(self, n: int):
        if n <= 0:
            raise ValueError(f"a signal pool needs n >= 1 signals, got {n}")
        self.n = n
        self.signals = symmetric.zeros((n,), torch.int64)

    def ptr(self, index: int = 0) -> int:
        """Device address of signal `index` (the same offset on every PE)."""
        if not 0 <= index < self.n:
            raise IndexError(f"signal {index} outside pool of {self.n}")
        return self.signals.data_ptr() + 8 * index

    def reset(self, stream=None) -> None:
        """Zero this PE's signals, then barrier so no peer signals into them before every PE has reset. Collective."""
        s = stream or torch.cuda.current_stream()
        with torch.cuda.stream(s):
            self.signals.zero_()
        barrier(s)

    def wait(self, index: int, at_least: int, stream=None) -> None:
        """Make `stream` wait (on the device, with the runtime's timeout) until signal `index` >= `at_least`."""
        args = abi.WaitArgs(ctx=ctx(), sig=self.ptr(index), expected=at_least, site=9, index=index)
        load("collectives").kernel("fs_wait_signal").launch(args, 1, 32, stream=stream)
