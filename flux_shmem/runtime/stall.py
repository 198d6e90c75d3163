"""Stall reports: what this process's last fused calls were waiting for when the host stopped making progress.

Device spin-waits time out and say which PE and which signal (signals.py). A stream can also wait where no
kernel spins and nothing times out: an event of a kernel that never became resident, a kernel launch queued
behind one, a link-emulation clock. With FLUX_SHMEM_STALL_REPORT_S=N, every op call ticks a counter, and a
thread prints, once no op was called for N s, each traced call's stages (CUDA events recorded after each step:
done or not), the device words the call depends on (read on a private stream) and the Python stacks of the
process's threads, on stderr, one report per stall.
Off by default: the events cost a few microseconds of host time per call. Imports nothing of flux_shmem.

The same stages, with timing events, give benchmarks a breakdown of a fused call (`timed_stages`): when its GEMM
ended, when its communication did.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from typing import Optional

ENV = "FLUX_SHMEM_STALL_REPORT_S"


def interval_from(env) -> Optional[float]:
    raw = env.get(ENV, "").strip()
    if not raw or raw == "0":
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds") from None
    if v <= 0:
        raise ValueError(f"{ENV}={raw!r} must be > 0 (or 0 / unset: off)")
    return v


@dataclasses.dataclass
class Trace:
    """One call of one op: its stages in issue order and the device words it depends on."""

    op: str
    call: int
    stages: list = dataclasses.field(default_factory=list)  # (label, stream name, torch.cuda.Event)
    words: list = dataclasses.field(default_factory=list)   # (label, int64 tensor, kept alive here)
    timed: bool = False  # timing events (timed_stages), else the cheaper plain ones

    def stage(self, label: str, stream, stream_name: str) -> None:
        import torch
        ev = torch.cuda.Event(enable_timing=self.timed)
        ev.record(stream)
        self.stages.append((label, stream_name, ev))

    def word(self, label: str, tensor) -> None:
        self.words.append((label, tensor))


class _Watcher:
    def __init__(self, interval: float, pe: int, device: int):
        self.interval, self.pe, self.device = interval, pe, device
        self.tick = 0
        self.last: dict[str, Trace] = {}
        self._reported_tick = -1
        self._since = time.monotonic()
        self._seen_tick = 0
        self._lock = threading.Lock()
        self._stream = None
        threading.Thread(target=self._run, name="flux_shmem-stall", daemon=True).start()

    def begin(self, op: str) -> Trace:
        with self._lock:
            self.tick += 1
            tr = self.last[op] = Trace(op, self.tick)
        return tr

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.interval / 4))
            with self._lock:
                tick = self.tick
            now = time.monotonic()
            if tick != self._seen_tick:
                self._seen_tick, self._since = tick, now
            elif now - self._since >= self.interval and self._reported_tick != tick:
                self._reported_tick = tick
                try:
                    print(self.report(now - self._since), file=sys.stderr, flush=True)
                except Exception as e:  # noqa: BLE001 - a report must never take the process down
                    print(f"flux_shmem: PE {self.pe}: stall report failed: {e!r}", file=sys.stderr, flush=True)

    def _read(self, tensor) -> str:
        """The tensor's int64 words, copied on a private non-blocking stream (the op's streams may be stuck)."""
        import ctypes
        from cuda.bindings import driver
        if self._stream is None:
            import torch
            torch.cuda.set_device(self.device)
            err, ctx = driver.cuDevicePrimaryCtxRetain(self.device)
            driver.cuCtxSetCurrent(ctx)
            self._stream = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)[1]
        n = min(tensor.numel(), 64)
        buf = (ctypes.c_int64 * n)()
        driver.cuMemcpyDtoHAsync(ctypes.addressof(buf), tensor.data_ptr(), 8 * n, self._stream)
        deadline = time.monotonic() + 5
        while driver.cuStreamQuery(self._stream)[0] != driver.CUresult.CUDA_SUCCESS:
            if time.monotonic() > deadline:
                return "<copy did not complete in 5 s>"
            time.sleep(0.01)
        vals = list(buf)
        more = f" ... ({tensor.numel()} words)" if tensor.numel() > n else ""
        return " ".join(str(v) for v in vals) + more

    def report(self, stalled_s: float) -> str:
        with self._lock:
            traces = sorted(self.last.values(), key=lambda t: t.call)
        lines = [f"flux_shmem: PE {self.pe}: no op call for {stalled_s:.0f} s ({ENV}); last call of each op, "
                 "stages in issue order:"]
        for tr in traces:
            lines.append(f"  {tr.op} call {tr.call}:")
            for label, stream, ev in tr.stages:
                lines.append(f"    [{'done' if ev.query() else 'PENDING'}] {label} ({stream})")
            for label, t in tr.words:
                lines.append(f"    {label} = {self._read(t)}")
        lines += _stacks()
        return "\n".join(lines)


def _stacks(frames: int = 12) -> list:
    """Where this process's other threads are (innermost last): a stall outside the traced ops shows here."""
    import traceback
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():  # noqa: SLF001 - the documented way to read other stacks
        if ident == threading.get_ident():
            continue
        out.append(f"  thread {names.get(ident, ident)}:")
        out += ["    " + ln.rstrip().replace("\n", "\n    ") for ln in traceback.format_stack(frame)[-frames:]]
    return out


_WATCHER: Optional[_Watcher] = None
_TIMED: Optional[list] = None  # timed_stages' collector


def start(pe: int, device: int) -> None:
    """init(): start the watcher when the environment asks for one."""
    global _WATCHER
    interval = interval_from(os.environ)
    if interval is not None and _WATCHER is None:
        _WATCHER = _Watcher(interval, pe, device)


def begin(op: str) -> Optional[Trace]:
    """An op call starts: a Trace to record its stages into, or None when neither stall reports nor
    timed_stages are on."""
    w, timed = _WATCHER, _TIMED
    if w is None and timed is None:
        return None
    tr = w.begin(op) if w is not None else Trace(op, len(timed))
    if timed is not None:
        tr.timed = True
        timed.append(tr)
    return tr


@contextlib.contextmanager
def timed_stages():
    """Inside the block every op call records its stages with timing events; yields the list their Traces are
    appended to (read the events once the stream is synchronized). Not reentrant."""
    global _TIMED
    if _TIMED is not None:
        raise RuntimeError("timed_stages() is already active")
    _TIMED = []
    try:
        yield _TIMED
    finally:
        _TIMED = None


def stage_offsets_ms(trace: Trace, start) -> list[tuple[str, str, float]]:
    """(label, stream name, ms since the `start` event) of a timed trace's stages, after a synchronize."""
    return [(label, stream, start.elapsed_time(ev)) for label, stream, ev in trace.stages]
