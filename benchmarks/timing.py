"""CUDA-event timing with warm-up and input rotation (GPU only; import lazily).

Each measured iteration is bracketed by two CUDA events on the current
stream; an optional ``sync`` callable runs before every iteration, outside
the events (``run.py`` passes a one-element NCCL all-reduce so that all ranks
start each iteration together without a host round trip).  Where ``sync``
waits on the host (ranks sharing a GPU line up through MPI), ``lead_us``
first queues that long a GPU sleep, outside the events: the host then
enqueues the timed call while the GPU sleeps, so the figure is device time,
not the host's launch path (which per_call_timing showed costing our GEMM
~0.3 ms per call on the H200 machine's host).  Input sets are
rotated (iteration ``i`` uses ``sets[i % len(sets)]``) so that weights and
activations are not still in L2 from the previous iteration.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

__all__ = ["cuda_time", "gpu_sleep", "relative_error", "l2_cache_bytes", "free_bytes"]


def cuda_time(
    fn: Callable,
    sets: Sequence[tuple],
    *,
    warmup: int,
    iters: int,
    sync: Optional[Callable[[], None]] = None,
    lead_us: float = 0.0,
) -> List[float]:
    """Per-iteration device times in ms of ``fn(*sets[i % len(sets)])``."""
    if not sets:
        raise ValueError("need at least one input set")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    n = len(sets)
    for i in range(max(warmup, 0)):
        if sync is not None:
            sync()
        fn(*sets[i % n])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if sync is not None:
            sync()
        if lead_us > 0:
            gpu_sleep(lead_us)
        starts[i].record()
        fn(*sets[(warmup + i) % n])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


_CYCLES_PER_US: Optional[float] = None


def gpu_sleep(us: float) -> None:
    """Queue about `us` microseconds of GPU spinning on the current stream (torch.cuda._sleep, one block),
    calibrated once against CUDA events."""
    global _CYCLES_PER_US
    if _CYCLES_PER_US is None:
        torch.cuda._sleep(100_000)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_US = 2_000_000 / max(start.elapsed_time(end) * 1e3, 1e-3)
    torch.cuda._sleep(max(1, int(us * _CYCLES_PER_US)))


@torch.no_grad()
def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F computed in fp32 (inf on shape mismatch or non-finite output)."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    ref = ref.float()
    num = torch.linalg.vector_norm(out.float() - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    r = num / den
    return r if r == r else float("inf")  # NaN -> inf


def l2_cache_bytes(device=None) -> int:
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 * 1024 * 1024))


def free_bytes() -> int:
    free, _total = torch.cuda.mem_get_info()
    return int(free)
