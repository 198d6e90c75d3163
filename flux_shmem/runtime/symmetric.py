"""Symmetric tensors: torch tensors on the NVSHMEM heap, at the same heap offset on every PE.

Allocation is collective. Before allocating, the PEs compare what they ask for; a PE that asks for another shape
or dtype makes every PE raise SymmetricMismatchError instead of corrupting the heap layout, and a PE that never
joins makes the others raise after the runtime's timeout instead of hanging.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..errors import FluxShmemError, SymmetricMismatchError
from . import collective
from .host import HostCollectives
from .state import get_runtime

# storage base address -> the tensor nvshmem4py returned (views of it map to peers through it)
_ALLOCATED: dict[int, torch.Tensor] = {}


def agree(what: str, value: Any, host: HostCollectives | None = None, timeout_s: float | None = None) -> None:
    """Collective check that every PE passes the same `value` for `what`; raises on all PEs otherwise.

    `host` defaults to the runtime's host collectives (MPI or torch.distributed), `timeout_s` to its timeout: a
    PE that never joins makes the others raise instead of hanging; one that failed before (collective.all_or_none)
    makes them raise naming it."""
    values = collective.exchange(what, value, host=host, timeout_s=timeout_s)
    if any(v != values[0] for v in values):
        per_pe = ", ".join(f"PE {i}: {v}" for i, v in enumerate(values))
        raise SymmetricMismatchError(f"PEs disagree on {what} ({per_pe}): symmetric allocations and ops must be "
                                     "created with the same arguments on every PE")


def _normalize_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialised symmetric tensor on this PE's GPU. Collective: every PE must call with the same arguments."""
    rt = get_runtime()
    shape = _normalize_shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    agree("flux_shmem.empty(shape, dtype)", (shape, str(dtype)))
    import nvshmem.core as nv
    numel = math.prod(shape)
    # nvshmem4py cannot allocate 0 bytes; keep one element and view it empty.
    t = nv.tensor((max(numel, 1),), dtype=dtype)
    if t is None:
        raise FluxShmemError("nvshmem4py returned no tensor: is torch importable in this environment?")
    _ALLOCATED[t.untyped_storage().data_ptr()] = t
    del rt
    return t[:numel].view(shape)


def zeros(shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeroed symmetric tensor. Collective; returns once every PE's copy is zero, so peers may signal into it."""
    t = empty(shape, dtype)
    t.zero_()
    torch.cuda.current_stream().synchronize()
    collective.exchange("flux_shmem.zeros (every PE's copy zeroed)")
    return t


def _base(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    base = _ALLOCATED.get(t.untyped_storage().data_ptr())
    if base is None:
        raise FluxShmemError("tensor is not symmetric: allocate it with flux_shmem.empty()/zeros() (a plain "
                             "torch tensor lives in this PE's private memory, which peers cannot address)")
    return base


def is_symmetric(t: torch.Tensor) -> bool:
    """True for flux_shmem.empty/zeros tensors and their views."""
    return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in _ALLOCATED


def peer(t: torch.Tensor, pe: int) -> torch.Tensor:
    """View of PE `pe`'s copy of symmetric tensor `t` (same shape, strides and offset), for direct loads/stores.

    Only for PEs in the same NVLink domain (`get_runtime().is_reachable(pe)`); others need put/get kernels.
    """
    rt = get_runtime()
    base = _base(t)
    if not rt.is_reachable(pe):
        raise FluxShmemError(f"PE {pe} is not load/store-reachable from PE {rt.rank} (another node, or no P2P "
                             "mapping): use the all-gather/put ops to move its data instead of a peer view")
    import nvshmem.core as nv
    if pe == rt.rank:
        remote = base
    else:
        remote = nv.get_peer_tensor(base, pe)
    flat = remote.reshape(-1).view(torch.uint8).view(t.dtype)
    return torch.as_strided(flat, t.size(), t.stride(), t.storage_offset())


def free(t: torch.Tensor) -> None:
    """Release a symmetric tensor (collective). Views of it must not be used afterwards."""
    base = _base(t)
    agree("flux_shmem.free(tensor of shape)", tuple(base.shape))
    import nvshmem.core as nv
    del _ALLOCATED[base.untyped_storage().data_ptr()]
    nv.free_tensor(base)


def _free_all() -> None:
    """At finalize (collective): free what is left, in allocation order, which is the same on every PE."""
    import nvshmem.core as nv
    for t in list(_ALLOCATED.values()):
        nv.free_tensor(t)
    _ALLOCATED.clear()
