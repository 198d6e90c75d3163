"""flux_shmem: tensor-parallel communication hidden inside GEMMs, on NVSHMEM.

    import flux_shmem
    rt = flux_shmem.init()                            # every rank, under mpirun / flux-launch or torchrun
    x = flux_shmem.zeros((rows, cols), torch.bfloat16) # symmetric tensor
    ag = flux_shmem.AllGather(rows, cols, torch.bfloat16)
    y = ag(x)
    flux_shmem.finalize()

Tensor-parallel layers for models: `flux_shmem.nn` (ColumnParallelLinear, RowParallelLinear).
Heavy imports (torch, NVSHMEM, CUDA) happen on first use, so `import flux_shmem` works anywhere.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (BuildError, FluxShmemError, NoGPUError, NotInitializedError, SignalTimeoutError,
                     SymmetricMismatchError)

__version__ = "0.1.0"

_LAZY = {
    "init": "runtime.bootstrap", "finalize": "runtime.bootstrap", "session": "runtime.bootstrap",
    "get_runtime": "runtime.state", "is_initialized": "runtime.state", "Runtime": "runtime.state",
    "empty": "runtime.symmetric", "zeros": "runtime.symmetric", "peer": "runtime.symmetric",
    "free": "runtime.symmetric", "is_symmetric": "runtime.symmetric",
    "barrier": "runtime.signals", "SignalPool": "runtime.signals", "check_errors": "runtime.signals",
    "AllGather": "ops.all_gather", "ReduceScatter": "ops.reduce_scatter",
    "AllGatherGEMM": "ops.ag_gemm", "GEMMReduceScatter": "ops.gemm_rs",
    "AllGatherGroupGEMM": "ops.moe", "GroupGEMMReduceScatter": "ops.moe",
}

_SUBMODULES = ("nn",)

__all__ = sorted(_LAZY) + list(_SUBMODULES) + ["BuildError", "FluxShmemError", "NoGPUError", "NotInitializedError",
                           "SignalTimeoutError", "SymmetricMismatchError"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flux_shmem' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from .ops.all_gather import AllGather
    from .ops.reduce_scatter import ReduceScatter
    from . import nn
    from .ops.ag_gemm import AllGatherGEMM
    from .ops.gemm_rs import GEMMReduceScatter
    from .ops.moe import AllGatherGroupGEMM, GroupGEMMReduceScatter
    from .runtime.bootstrap import finalize, init, session
    from .runtime.state import Runtime, get_runtime, is_initialized
    from .runtime.signals import SignalPool, barrier, check_errors
    from .runtime.symmetric import empty, free, is_symmetric, peer, zeros
