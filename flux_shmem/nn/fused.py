"""FusedBackend: the layers' products on flux_shmem's fused ops (AllGatherGEMM, GEMMReduceScatter).

One op object per (kind, n, k, dtype), shared by every layer with that shape (calls run one after another on
the stream, so sharing is safe and saves symmetric memory), built on first use for the M of that call rounded
up to a power of two per PE, and rebuilt larger when a bigger batch arrives. Building is collective: the PEs
first agree on the new size, so PEs that see different M raise SymmetricMismatchError together instead of
corrupting the heap. Symmetric memory is never returned to NVSHMEM before finalize(), so pass `max_m` (tokens per
call, all PEs together) when it is known, to build each op once.

Shapes the fused ops cannot run (a dtype other than bf16/fp16, K or N not a multiple of 8, CPU tensors) go to
`TorchBackend` on the matching torch.distributed group, reported once per reason.
"""
from __future__ import annotations

import threading
import warnings

import torch

from ..runtime import state, symmetric
from ..runtime.state import get_runtime
from .backends import TorchBackend

FUSED_DTYPES = (torch.bfloat16, torch.float16)


def grown_max_m(m: int, world: int, min_m: int = 0, old: int = 0) -> int:
    """Rows to build an op for when a call has m rows and the op holds `old` (0: none yet): `min_m` (rounded up to
    a multiple of the world) while m fits in it, else the next power of two rows per PE times the world, at least
    twice the old size (so an op is rebuilt O(log M) times at most)."""
    floor = -(-min_m // world) * world
    if m <= floor and floor > old:
        return floor
    rows = -(-m // world)
    return max(world * (1 << max(0, rows - 1).bit_length()), 2 * old)


def why_unsupported(device_type: str, dtypes: tuple[torch.dtype, ...], k: int, n: int) -> str | None:
    """Why the fused ops cannot multiply [m, k] @ [k, n] on `device_type` with operands of `dtypes`, or None."""
    if device_type != "cuda":
        return f"tensors on {device_type} (the fused ops run on CUDA)"
    if dtypes[0] not in FUSED_DTYPES or any(d != dtypes[0] for d in dtypes):
        return (f"dtypes {', '.join(str(d) for d in dtypes)} (the fused ops take bfloat16 or float16, the same for "
                "input, weight and bias)")
    if k % 8 or n % 8:
        return f"K = {k}, N = {n} (the fused ops need multiples of 8: 16-byte rows for TMA)"
    return None


def unsupported(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the fused ops cannot compute a @ b (+ bias), or None."""
    dtypes = (a.dtype, b.dtype) + ((bias.dtype,) if bias is not None else ())
    return why_unsupported(a.device.type, dtypes, b.shape[0], b.shape[1])


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Row-major and 16-byte aligned, as the ops require (grads and compiled views need not be)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _b_operand(b: torch.Tensor) -> torch.Tensor:
    """b as the ops take it: row-major [K, N] or the transpose of a row-major [N, K], 16-byte aligned."""
    if b.t().is_contiguous() and not b.is_contiguous():
        w = b.t()
        return (w if w.data_ptr() % 16 == 0 else w.clone()).t()
    return _aligned(b)


class FusedBackend:
    """The layers' products on flux_shmem's fused ops (flux_shmem.init() first).

    mode: the ops' 'auto' (fused unless the GEMM is too small to hide anything), 'fused' or 'decomposed'.
    max_m: rows (tokens, all PEs together) to build every op for up front; ops grow past it when needed.
    fallback_group: torch.distributed group for shapes the fused ops cannot run (default: the default group,
    when it spans the same ranks). Extra keywords go to AllGatherGEMM (e.g. engine='ce', chunk_rows).
    """

    name = "fused"

    def __init__(self, *, mode: str = "auto", max_m: int = 0, fallback_group=None, **ag_options):
        rt = get_runtime()
        self.rank, self.world_size = rt.rank, rt.world_size
        self.mode, self.min_m, self.ag_options = mode, int(max_m), ag_options
        self._fallback_group = fallback_group
        self._fallback: TorchBackend | None = None
        self._ops: dict[tuple, object] = {}
        self._reported: set[str] = set()
        self._lock = threading.Lock()  # forward (main thread) and backward (autograd thread) share the pool

    def __repr__(self) -> str:
        ops = ", ".join(f"{kind}(n={n}, k={k}, max_m={getattr(op, 'max_m', None)})"
                        for (kind, n, k, _), op in self._ops.items())
        return f"FusedBackend(mode={self.mode!r}, world_size={self.world_size}, ops=[{ops}])"

    # ---------------------------------------------------------------------------------------------- op pool
    def op(self, kind: str, m: int, n: int, k: int, dtype: torch.dtype):
        """The op of `kind` ('ag_gemm' or 'gemm_rs') for [m, k] @ [k, n], built or grown collectively if needed."""
        key = (kind, n, k, dtype)
        with self._lock:
            op = self._ops.get(key)
            if op is not None and m <= op.max_m:
                return op
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"flux_shmem.nn: {kind}(n={n}, k={k}) must be built for M = {m} while a CUDA "
                                   "graph is being captured: run one step eagerly with the largest M first, or "
                                   "pass FusedBackend(max_m=...)")
            new_m = grown_max_m(m, self.world_size, self.min_m, op.max_m if op is not None else 0)
            symmetric.agree(f"the size of flux_shmem.nn's {kind}(n={n}, k={k}, {dtype}) op, from the rows M of "
                            "this call (every PE must pass the same M to each layer call)", new_m)
            from ..ops.ag_gemm import AllGatherGEMM
            from ..ops.gemm_rs import GEMMReduceScatter
            self._ops[key] = None  # the old op is dropped first (its buffers stay allocated until finalize)
            if kind == "ag_gemm":
                op = AllGatherGEMM(new_m, n, k, dtype, mode=self.mode, **self.ag_options)
            else:
                op = GEMMReduceScatter(new_m, n, k, dtype, mode=self.mode)
            self._ops[key] = op
            return op

    def ops(self) -> dict:
        """The op objects built so far, by (kind, n, k, dtype)."""
        return dict(self._ops)

    # ---------------------------------------------------------------------------------------------- fallback
    def fallback(self, what: str, why: str) -> TorchBackend:
        if why not in self._reported:
            self._reported.add(why)
            warnings.warn(f"flux_shmem.nn: {what} runs on torch.distributed + torch.matmul instead of the fused "
                          f"ops: {why}", stacklevel=3)
        if self._fallback is None:
            self._fallback = self._make_fallback()
        return self._fallback

    def _make_fallback(self) -> TorchBackend:
        import torch.distributed as dist
        if self.world_size == 1:
            return TorchBackend()
        if state.get_runtime().shares_gpu:
            raise RuntimeError("flux_shmem.nn: this shape needs the torch.distributed fallback, but several PEs "
                               "share one GPU, where NCCL cannot run: use shapes the fused ops take (bf16/fp16 "
                               "CUDA tensors, K and N multiples of 8), or one GPU per PE")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("flux_shmem.nn: this shape needs the torch.distributed fallback, but "
                               "torch.distributed is not initialised: call torch.distributed.init_process_group() "
                               "(NCCL, one GPU per rank) before the first step, or change the shape (bf16/fp16 "
                               "CUDA tensors, K and N multiples of 8)")
        fb = TorchBackend(self._fallback_group)
        if (fb.rank, fb.world_size) != (self.rank, self.world_size):
            raise RuntimeError(f"flux_shmem.nn: the torch.distributed group is rank {fb.rank} of {fb.world_size}, "
                               f"flux_shmem rank {self.rank} of {self.world_size}: pass "
                               "FusedBackend(fallback_group=...) spanning flux_shmem's PEs in rank order")
        return fb

    # ---------------------------------------------------------------------------------------------- products
    def ag_gemm(self, a_shard, b, bias, return_gathered):
        why = unsupported(a_shard, b, bias)
        if why:
            return self.fallback("all-gather + GEMM", why).ag_gemm(a_shard, b, bias, return_gathered)
        a_shard, b = _aligned(a_shard), _b_operand(b)
        bias = _aligned(bias) if bias is not None else None
        op = self.op("ag_gemm", a_shard.shape[0] * self.world_size, b.shape[1], b.shape[0], a_shard.dtype)
        if return_gathered:
            return op(a_shard, b, bias, return_gathered=True)
        return op(a_shard, b, bias), None

    def gemm_rs(self, a, b, bias):
        why = unsupported(a, b, bias)
        if why:
            return self.fallback("GEMM + reduce-scatter", why).gemm_rs(a, b, bias)
        a, b = _aligned(a), _b_operand(b)
        bias = _aligned(bias) if bias is not None else None
        op = self.op("gemm_rs", a.shape[0], b.shape[1], b.shape[0], a.dtype)
        return op(a, b, bias)
