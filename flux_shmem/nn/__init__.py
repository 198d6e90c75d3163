"""Tensor-parallel layers for models: Megatron-style column/row-parallel linear layers with sequence parallelism,
their communication hidden inside the GEMMs forward and backward, traceable by torch.compile.

    import flux_shmem, flux_shmem.nn as fnn
    flux_shmem.init()                                   # under flux-launch/mpirun or torchrun
    up = fnn.ColumnParallelLinear(4096, 14336, bias=False, dtype=torch.bfloat16)
    down = fnn.RowParallelLinear(14336, 4096, bias=False, dtype=torch.bfloat16)
    y = down(F.silu(up(x_shard)))                       # x_shard: this PE's [s/W, b, 4096]

layers.py: the modules; custom_ops.py: torch.ops.flux_shmem.ag_gemm / gemm_rs (fake kernels, autograd);
backends.py: who runs the products (TorchBackend: torch.distributed + matmul) and the handle registry;
fused.py: FusedBackend (flux_shmem's fused ops, sized for the largest M seen); moe.py: MoE (tensor-parallel
experts over the MoE ops, autograd in eager mode).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import custom_ops  # noqa: F401  (registers torch.ops.flux_shmem.ag_gemm / gemm_rs)
from .backends import Backend, TorchBackend, lookup, register
from .layers import ColumnParallelLinear, RowParallelLinear, default_backend

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "MoE", "Backend", "TorchBackend", "FusedBackend",
           "default_backend", "register", "lookup"]


def __getattr__(name: str):
    if name == "FusedBackend":  # imports the ops (CUDA-side modules) only when asked for
        from .fused import FusedBackend
        return FusedBackend
    if name == "MoE":
        from .moe import MoE
        return MoE
    raise AttributeError(f"module 'flux_shmem.nn' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from .fused import FusedBackend
    from .moe import MoE
