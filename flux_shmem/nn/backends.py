"""Who computes the layers' two tensor-parallel products, and the registry the custom ops find them in.

A backend does two things, forward and backward alike:
    ag_gemm(a_shard, b, bias, return_gathered) -> (all_gather(a_shard) @ b + bias, the gathered a or None)
    gemm_rs(a, b, bias)                         -> reduce_scatter(a @ b) + bias
with b a [K, N] matrix (row-major, or the transpose of a row-major [N, K] weight). `FusedBackend` (fused.py)
runs flux_shmem's fused ops; `TorchBackend` runs torch.distributed collectives and matmuls (the fallback, and
the plain-torch baseline). Custom ops take tensors and numbers only, so they name their backend by an integer
handle from `register()`.
"""
from __future__ import annotations

import threading
from typing import Protocol

import torch

_REGISTRY: dict[int, "Backend"] = {}
_LOCK = threading.Lock()


class Backend(Protocol):
    name: str
    rank: int
    world_size: int

    def ag_gemm(self, a_shard: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                return_gathered: bool) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def gemm_rs(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


def register(backend: Backend) -> int:
    """The integer handle the custom ops use to reach `backend` (the same object gets the same handle)."""
    with _LOCK:
        for h, b in _REGISTRY.items():
            if b is backend:
                return h
        handle = len(_REGISTRY) + 1
        _REGISTRY[handle] = backend
        return handle


def lookup(handle: int) -> Backend:
    try:
        return _REGISTRY[handle]
    except KeyError:
        raise KeyError(f"flux_shmem.nn: no backend registered under handle {handle} (layers register theirs when "
                       "built; a handle from another process means nothing here)") from None


def _collective(name: str):
    """dist.<name>_single in torch >= 2.13, dist.<old name> before (the same call)."""
    import torch.distributed as dist
    new, old = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}[name]
    return getattr(dist, new, None) or getattr(dist, old)


def add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out.add_(bias)


class TorchBackend:
    """all_gather / reduce_scatter of torch.distributed (NCCL for CUDA tensors, gloo for CPU ones) around
    torch.matmul: plain tensor parallelism, nothing overlapped. `group` defaults to the default group; with a world
    of one no collective runs (and torch.distributed need not be initialised)."""

    name = "torch"

    def __init__(self, group=None):
        import torch.distributed as dist
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        elif group is not None:
            raise RuntimeError("TorchBackend(group=...) needs torch.distributed initialised")
        else:
            self.rank, self.world_size = 0, 1

    def __repr__(self) -> str:
        return f"TorchBackend(rank={self.rank}, world_size={self.world_size})"

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x.clone()
        x = x.contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _collective("all_gather")(out, x, group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        _collective("reduce_scatter")(out, x, group=self.group)
        return out

    def ag_gemm(self, a_shard, b, bias, return_gathered):
        full = self.all_gather(a_shard)
        return add_bias(full @ b, bias), (full if return_gathered else None)

    def gemm_rs(self, a, b, bias):
        return add_bias(self.reduce_scatter(a @ b), bias)
