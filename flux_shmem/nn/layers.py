"""ColumnParallelLinear and RowParallelLinear: Megatron-style tensor-parallel linear layers with sequence
parallelism, the communication hidden inside the GEMMs forward and backward.

Activations between a row-parallel and the next column-parallel layer are split along the first dimension (the
sequence, in Megatron's [s, b, h] layout: PE r holds positions [r*s/W, (r+1)*s/W)); inside the pair they are
split along features. A Llama MLP is `down(silu(gate(x)) * up(x))` with gate/up column-parallel and down
row-parallel; attention is QKV column-parallel and o_proj row-parallel.

    ColumnParallelLinear  x [s/W, ..., in]   -> [s, ..., out/W]   weight [out/W, in],  bias [out/W]
    RowParallelLinear     x [s, ..., in/W]   -> [s/W, ..., out]   weight [out, in/W],  bias [out] (replicated)

Both run through the custom ops of custom_ops.py (torch.compile traces them; autograd gives every gradient in
full: the row layer's bias gradient is the sum over all PEs' rows, the same on every PE).
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import state
from . import backends, custom_ops  # noqa: F401  (custom_ops registers torch.ops.flux_shmem.*)
from .backends import Backend, TorchBackend

_WARNED_WORLD_ONE = False
_DEFAULT_TORCH: dict[int, TorchBackend] = {}


def default_backend(kind: str | None = None) -> Backend | None:
    """The backend layers use when given none (or given 'fused' / 'torch'): flux_shmem's fused ops when
    flux_shmem is initialised, else torch.distributed when it is, else None (a world of one: plain F.linear)."""
    if kind not in (None, "fused", "torch"):
        raise ValueError(f"backend must be a Backend object, 'fused', 'torch' or None, got {kind!r}")
    if kind == "fused" or (kind is None and state.is_initialized()):
        from .fused import FusedBackend
        rt = state.get_runtime()  # NotInitializedError names the fix
        if "nn_backend" not in rt._internal:  # one pool of ops per runtime; finalize() drops it
            rt._internal["nn_backend"] = FusedBackend()
        return rt._internal["nn_backend"]
    import torch.distributed as dist
    if kind == "torch" or (dist.is_available() and dist.is_initialized()):
        key = id(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else 0
        if key not in _DEFAULT_TORCH:
            _DEFAULT_TORCH[key] = TorchBackend()
        return _DEFAULT_TORCH[key]
    return None


def _resolve(backend) -> tuple[Backend | None, int]:
    """(backend, handle); handle 0 means plain torch in a world of one."""
    global _WARNED_WORLD_ONE
    explicit = backend is not None and not isinstance(backend, str)
    b = backend if explicit else default_backend(backend)
    if b is None or (b.world_size == 1 and backend is None):
        if not _WARNED_WORLD_ONE:
            _WARNED_WORLD_ONE = True
            warnings.warn("flux_shmem.nn: a world of one PE: the parallel layers run plain torch "
                          "(F.linear); pass backend='fused' to run the fused ops' GEMMs anyway", stacklevel=3)
        return b, 0
    return b, backends.register(b)


def _default_device() -> torch.device | None:
    """This PE's GPU once flux_shmem is initialised; else torch's default (like torch.nn.Linear)."""
    return torch.device("cuda", state.get_runtime().device) if state.is_initialized() else None


def _split(total: int, world: int, what: str, cls: str) -> int:
    if total % world:
        raise ValueError(f"{cls}: {what} = {total} does not split over {world} PEs: use a multiple of {world}")
    return total // world


class _ParallelLinear(nn.Module):
    """Weight [out_local, in_local] like torch.nn.Linear's, bias optional; shared construction and loading."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend, device, dtype,
                 shard_out: bool):
        super().__init__()
        b, self._handle = _resolve(backend)  # the module keeps the handle only: copies share the backend
        self.world_size = b.world_size if b is not None else 1
        self.rank = b.rank if b is not None else 0
        cls = type(self).__name__
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.in_local = self.in_features if shard_out else _split(self.in_features, self.world_size, "in_features", cls)
        self.out_local = _split(self.out_features, self.world_size, "out_features", cls) if shard_out \
            else self.out_features
        if device is None:
            device = _default_device()
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty((self.out_local, self.in_local), **kw))
        bias_len = self.out_local if shard_out else self.out_features
        self.bias = nn.Parameter(torch.empty(bias_len, **kw)) if bias else None
        self.reset_parameters()

    @property
    def backend(self) -> Backend | None:
        """Who computes the products (None: plain torch, a world of one)."""
        return backends.lookup(self._handle) if self._handle else None

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(in_features) like torch.nn.Linear, with the full layer's fan-in."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"local weight={list(self.weight.shape)}, rank={self.rank}, world_size={self.world_size}, "
                f"backend={getattr(self.backend, 'name', 'torch (world of one)')}")

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or x.shape[-1] != self.in_local:
            raise ValueError(f"{type(self).__name__}: input of shape {tuple(x.shape)}; expected [tokens, ..., "
                             f"{self.in_local}] (this PE's {'features' if self.in_local != self.in_features else 'in_features'})")


class ColumnParallelLinear(_ParallelLinear):
    """y = x @ W^T + b with W split along its output features; the input's sequence shards are all-gathered
    inside the GEMM (AllGatherGEMM), and in backward the input gradient is reduce-scattered inside the dgrad
    GEMM (GEMMReduceScatter).

    x: [s/W, ..., in_features] (this PE's sequence shard) -> [s, ..., out_features/W] (this PE's features).
    backend: None (flux_shmem's fused ops when flux_shmem is initialised, else torch.distributed, else plain
    torch for a world of one), 'fused', 'torch', or a Backend object (flux_shmem.nn.FusedBackend(...), ...).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, backend=None, device=None,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias, backend, device, dtype, shard_out=True)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "ColumnParallelLinear":
        """Copy this PE's rows of the full [out_features, in_features] weight (and bias) in."""
        lo, hi = self.rank * self.out_local, (self.rank + 1) * self.out_local
        self.weight.copy_(weight[lo:hi])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias[lo:hi])
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if self._handle == 0:
            return F.linear(x, self.weight, self.bias)
        keep_gathered = torch.is_grad_enabled() and self.weight.requires_grad  # saved for the weight gradient
        out, _ = torch.ops.flux_shmem.ag_gemm(x.reshape(-1, self.in_features), self.weight.t(), self.bias,
                                              self._handle, self.world_size, keep_gathered)
        return out.view(x.shape[0] * self.world_size, *x.shape[1:-1], self.out_local)


class RowParallelLinear(_ParallelLinear):
    """y = x @ W^T + b with W split along its input features; the partial products are reduce-scattered over
    the sequence inside the GEMM (GEMMReduceScatter), and in backward the output gradient is all-gathered inside
    the dgrad GEMM (AllGatherGEMM). The bias is replicated and added once.

    x: [s, ..., in_features/W] (this PE's features) -> [s/W, ..., out_features] (this PE's sequence shard).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, backend=None, device=None,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias, backend, device, dtype, shard_out=False)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "RowParallelLinear":
        """Copy this PE's columns of the full [out_features, in_features] weight (and the whole bias) in."""
        lo, hi = self.rank * self.in_local, (self.rank + 1) * self.in_local
        self.weight.copy_(weight[:, lo:hi])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if self._handle == 0:
            return F.linear(x, self.weight, self.bias)
        W = self.world_size
        if x.shape[0] % W:
            raise ValueError(f"RowParallelLinear: the first (sequence) dimension is {x.shape[0]}, not a multiple "
                             f"of the {W} PEs it is scattered over: pad the sequence to a multiple of {W}")
        out = torch.ops.flux_shmem.gemm_rs(x.reshape(-1, self.in_local), self.weight.t(), self.bias, self._handle, W)
        return out.view(x.shape[0] // W, *x.shape[1:-1], self.out_features)
