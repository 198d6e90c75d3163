"""`torch.ops.flux_shmem.ag_gemm` and `torch.ops.flux_shmem.gemm_rs`: the layers' products as torch.library custom
ops, with fake kernels (torch.compile and FakeTensorMode trace them without running anything) and autograd
formulas that are the other op (the backward of an all-gather is a reduce-scatter and vice versa):

    ag_gemm(a_shard [m/W, K], b [K, N], bias [N]?) -> out [m, N] = all_gather(a_shard) @ b + bias,
                                                      gathered [m, K] (or [0, K] unless return_gathered)
        grad_a_shard = gemm_rs(grad_out, b^T)           (reduce-scatter hidden in the dgrad GEMM)
        grad_b       = gathered^T @ grad_out            (local)
        grad_bias    = grad_out.sum(0)                  (local: the bias is this PE's shard)

    gemm_rs(a [m, K], b [K, N], bias [N]?) -> out [m/W, N] = reduce_scatter(a @ b) + bias (bias added once)
        grad_a, gathered_grad = ag_gemm(grad_out, b^T)  (all-gather of grad_out hidden in the dgrad GEMM)
        grad_b       = a^T @ gathered_grad              (local)
        grad_bias    = gathered_grad.sum(0)             (the full sum over every PE's rows: identical on all PEs)

Ops take the backend's integer `handle` (backends.register) and the world size W (so fake kernels need no
backend). Every PE must call them in the same order with the same shapes (they are collectives).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import backends


def _is_transposed(b: Tensor) -> bool:
    """b is w.t() of a row-major w [N, K] (and not itself row-major)."""
    return not b.is_contiguous() and b.t().is_contiguous()


def _wgrad(x: Tensor, grad: Tensor, b_transposed: bool) -> Tensor:
    """x^T @ grad, computed so that a transposed b (= w.t()) gets a row-major w-gradient."""
    return (grad.t() @ x).t() if b_transposed else x.t() @ grad


@torch.library.custom_op("flux_shmem::ag_gemm", mutates_args=())
def ag_gemm(a_shard: Tensor, b: Tensor, bias: Optional[Tensor], handle: int, world: int,
            return_gathered: bool) -> tuple[Tensor, Tensor]:
    out, gathered = backends.lookup(handle).ag_gemm(a_shard, b, bias, return_gathered)
    if gathered is None:
        gathered = a_shard.new_empty((0, a_shard.shape[1]))
    return out, gathered


@ag_gemm.register_fake
def _ag_gemm_fake(a_shard, b, bias, handle, world, return_gathered):
    torch._check(a_shard.shape[1] == b.shape[0], lambda: f"ag_gemm: a_shard has {a_shard.shape[1]} columns, b "
                                                         f"{b.shape[0]} rows")
    m = a_shard.shape[0] * world
    return a_shard.new_empty((m, b.shape[1])), a_shard.new_empty((m if return_gathered else 0, a_shard.shape[1]))


@torch.library.custom_op("flux_shmem::gemm_rs", mutates_args=())
def gemm_rs(a: Tensor, b: Tensor, bias: Optional[Tensor], handle: int, world: int) -> Tensor:
    return backends.lookup(handle).gemm_rs(a, b, bias)


@gemm_rs.register_fake
def _gemm_rs_fake(a, b, bias, handle, world):
    torch._check(a.shape[1] == b.shape[0], lambda: f"gemm_rs: a has {a.shape[1]} columns, b {b.shape[0]} rows")
    torch._check(a.shape[0] % world == 0, lambda: f"gemm_rs: {a.shape[0]} rows do not split over {world} PEs")
    return a.new_empty((a.shape[0] // world, b.shape[1]))


def _ag_gemm_setup(ctx, inputs, output):
    a_shard, b, bias, handle, world, return_gathered = inputs
    ctx.handle, ctx.world, ctx.b_transposed = handle, world, _is_transposed(b)
    ctx.save_for_backward(b, output[1])


def _ag_gemm_backward(ctx, grad_out, _grad_gathered):
    b, gathered = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    grad_a = grad_b = grad_bias = None
    if need_a:
        grad_a = torch.ops.flux_shmem.gemm_rs(grad_out, b.t(), None, ctx.handle, ctx.world)
    if need_b:
        if gathered.shape[0] == 0:
            raise RuntimeError("flux_shmem::ag_gemm: b needs a gradient but the forward ran with "
                               "return_gathered=False: call it with return_gathered=True when b requires grad")
        grad_b = _wgrad(gathered, grad_out, ctx.b_transposed)
    if need_bias:
        grad_bias = grad_out.sum(0)
    return grad_a, grad_b, grad_bias, None, None, None


def _gemm_rs_setup(ctx, inputs, output):
    a, b, bias, handle, world = inputs
    ctx.handle, ctx.world, ctx.b_transposed = handle, world, _is_transposed(b)
    ctx.save_for_backward(a, b)


def _gemm_rs_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    # The all-gather of grad_out is needed for any gradient; the GEMM beside it gives grad_a.
    grad_a, gathered = torch.ops.flux_shmem.ag_gemm(grad_out, b.t(), None, ctx.handle, ctx.world,
                                                     need_b or need_bias)
    grad_b = _wgrad(a, gathered, ctx.b_transposed) if need_b else None
    grad_bias = gathered.sum(0) if need_bias else None
    return (grad_a if need_a else None), grad_b, grad_bias, None, None


ag_gemm.register_autograd(_ag_gemm_backward, setup_context=_ag_gemm_setup)
gemm_rs.register_autograd(_gemm_rs_backward, setup_context=_gemm_rs_setup)
