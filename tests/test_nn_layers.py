"""flux_shmem.nn on the CPU: sharding, the autograd math of both layers and of the Llama block against an unsharded
reference (in a world of 1, 2 and 4 PEs simulated by threads, float64: exact up to rounding), the fake kernels,
torch.library.opcheck of the custom ops, and torch.compile(fullgraph=True) tracing them."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import flux_shmem.nn as fnn
from benchmarks.llama_block import BlockConfig, ReferenceBlock, TPBlock, compare_step, seq_shard, shard_full
from nn_world import ThreadRankBackend, ThreadWorld

F64 = torch.float64


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> bool:
    return a.shape == b.shape and ((a - b).norm() / b.norm().clamp_min(1e-30)).item() < tol


def full_tensors(seed: int, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=F64) for s in shapes]


# ------------------------------------------------------------------------------------------------ sharding
def test_shard_shapes_and_load_full():
    world = ThreadWorld(4)
    w, b = full_tensors(0, (32, 16), (32,))
    for r in range(4):
        be = ThreadRankBackend(world, r)
        col = fnn.ColumnParallelLinear(16, 32, backend=be, dtype=F64).load_full(w, b)
        assert col.weight.shape == (8, 16) and col.bias.shape == (8,)
        assert torch.equal(col.weight, w[8 * r:8 * (r + 1)]) and torch.equal(col.bias, b[8 * r:8 * (r + 1)])
        row = fnn.RowParallelLinear(32, 16, backend=be, dtype=F64).load_full(w.t().contiguous(), b[:16])
        assert row.weight.shape == (16, 8) and row.bias.shape == (16,)
        assert torch.equal(row.weight, w.t()[:, 8 * r:8 * (r + 1)]) and torch.equal(row.bias, b[:16])
        assert "local weight=[16, 8]" in repr(row) and "world_size=4" in repr(row)
    with pytest.raises(ValueError, match="multiple of 4"):
        fnn.ColumnParallelLinear(16, 30, backend=ThreadRankBackend(world, 0))
    with pytest.raises(ValueError, match="multiple of 4"):
        fnn.RowParallelLinear(30, 16, backend=ThreadRankBackend(world, 0))


def test_init_bound_uses_the_full_fan_in():
    world = ThreadWorld(4)
    torch.manual_seed(0)
    row = fnn.RowParallelLinear(4096, 64, backend=ThreadRankBackend(world, 0))
    assert row.weight.abs().max() <= 1 / 4096 ** 0.5 and row.weight.abs().max() > 0.9 / 4096 ** 0.5


def test_bad_inputs_name_the_fix():
    world = ThreadWorld(2)
    be = ThreadRankBackend(world, 0)
    row = fnn.RowParallelLinear(16, 8, backend=be, dtype=F64)
    with pytest.raises(ValueError, match="multiple of the 2 PEs"):
        row(torch.zeros(3, 8, dtype=F64))
    with pytest.raises(ValueError, match=r"expected \[tokens, ..., 8\]"):
        row(torch.zeros(4, 16, dtype=F64))
    with pytest.raises(ValueError, match="backend must be"):
        fnn.ColumnParallelLinear(8, 8, backend="nccl")


def test_world_of_one_runs_plain_torch_and_says_so_once(monkeypatch):
    from flux_shmem.nn import layers
    monkeypatch.setattr(layers, "_WARNED_WORLD_ONE", False)
    with pytest.warns(UserWarning, match="world of one"):
        col = fnn.ColumnParallelLinear(16, 8, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        row = fnn.RowParallelLinear(8, 16, bias=False, dtype=F64)
    assert col.backend is None and col._handle == 0 and col.world_size == 1
    x = torch.randn(5, 3, 16, dtype=F64)
    assert torch.equal(col(x), F.linear(x, col.weight, col.bias))
    assert row(col(x)).shape == (5, 3, 16)


# ------------------------------------------------------------------------------------------------ autograd math
def run_layers(W: int, bias: bool, s: int = 8, b: int = 3, d_in: int = 12, d_hid: int = 16, *,
               freeze_weights: bool = False, input_grad: bool = True):
    """Column -> gelu -> row on every simulated PE, against the same two layers unsharded."""
    w1, b1, w2, b2, x, gy = full_tensors(W * 10 + bias, (d_hid, d_in), (d_hid,), (d_in, d_hid), (d_in,),
                                         (s, b, d_in), (s, b, d_in))
    xr = x.clone().requires_grad_(input_grad)
    p = [t.clone().requires_grad_(not freeze_weights) for t in (w1, b1, w2, b2)]
    y = F.linear(F.gelu(F.linear(xr, p[0], p[1] if bias else None)), p[2], p[3] if bias else None)
    y.backward(gy)
    world = ThreadWorld(W)

    def rank(r: int):
        be = ThreadRankBackend(world, r)
        col = fnn.ColumnParallelLinear(d_in, d_hid, bias=bias, backend=be, dtype=F64).load_full(w1, b1)
        row = fnn.RowParallelLinear(d_hid, d_in, bias=bias, backend=be, dtype=F64).load_full(w2, b2)
        for m in (col, row):
            m.requires_grad_(not freeze_weights)
        xs = seq_shard(x, r, W).clone().requires_grad_(input_grad)
        h = col(xs)
        assert h.shape == (s, b, d_hid // W)
        ys = row(F.gelu(h))
        assert ys.shape == (s // W, b, d_in)
        ys.backward(seq_shard(gy, r, W))
        return ys, xs.grad, col, row, be.calls

    for r, (ys, gx, col, row, calls) in enumerate(world.run(rank)):
        hs, he = r * (d_hid // W), (r + 1) * (d_hid // W)
        assert close(ys, seq_shard(y, r, W))
        if input_grad:
            assert close(gx, seq_shard(xr.grad, r, W))
        if freeze_weights:
            assert all(t.grad is None for t in (col.weight, row.weight))
        else:
            assert close(col.weight.grad, p[0].grad[hs:he]) and close(row.weight.grad, p[2].grad[:, hs:he])
            if bias:
                assert close(col.bias.grad, p[1].grad[hs:he]) and close(row.bias.grad, p[3].grad)
        # forward: AG (col) then RS (row); backward: AG of grad_out (row), then RS of the dgrad (col) if needed
        kinds = [c[0] for c in calls]
        assert kinds[:2] == ["ag_gemm", "gemm_rs"] and kinds[2] == "ag_gemm"
        assert kinds[3:] == (["gemm_rs"] if input_grad else [])


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_layers_match_unsharded(W, bias):
    run_layers(W, bias)


def test_frozen_weights_and_inputs_without_grad():
    run_layers(2, True, freeze_weights=True)   # no gathered input kept, input gradient still exact
    run_layers(2, True, input_grad=False)      # no dgrad reduce-scatter for the first layer's input


def test_llama_block_matches_unsharded():
    cfg = BlockConfig(hidden=32, heads=8, kv_heads=4, head_dim=4, ffn=48, bias=True)
    W, s, b = 4, 8, 2
    x, gy = full_tensors(3, (s, b, cfg.hidden), (s, b, cfg.hidden))
    torch.manual_seed(0)
    ref_block = ReferenceBlock(cfg, dtype=F64)
    y = ref_block(xr := x.clone().requires_grad_(True))
    y.backward(gy)
    ref = (y.detach(), xr.grad, {n: q.grad for n, q in ref_block.named_parameters()},
           {n: q.detach() for n, q in ref_block.named_parameters()})
    world = ThreadWorld(W)

    def rank(r: int):
        blk = TPBlock(cfg, backend=ThreadRankBackend(world, r), dtype=F64)
        blk.load_state_dict(shard_full(cfg, ref[3], r, W))
        return compare_step(blk, seq_shard(x, r, W), seq_shard(gy, r, W), ref)

    for errs in world.run(rank):
        assert len(errs) == 2 + 8 and max(errs.values()) < 1e-10, errs


# ------------------------------------------------------------------------------------------------ custom ops
def test_fake_kernels_give_shapes_without_a_backend():
    with FakeTensorMode():
        a, b, bias = torch.empty(8, 16), torch.empty(24, 16).t(), torch.empty(24)
        out, gathered = torch.ops.flux_shmem.ag_gemm(a, b, bias, 987654, 4, True)  # no backend 987654 exists
        assert out.shape == (32, 24) and gathered.shape == (32, 16)
        assert torch.ops.flux_shmem.ag_gemm(a, b, None, 987654, 4, False)[1].shape == (0, 16)
        assert torch.ops.flux_shmem.gemm_rs(torch.empty(32, 16), b, bias, 987654, 4).shape == (8, 24)
        with pytest.raises(Exception, match="do not split over 3"):
            torch.ops.flux_shmem.gemm_rs(torch.empty(32, 16), b, None, 987654, 3)


def test_unknown_handle_is_a_clear_error():
    with pytest.raises(KeyError, match="no backend registered under handle 987654"):
        torch.ops.flux_shmem.gemm_rs(torch.ones(2, 2), torch.ones(2, 2), None, 987654, 1)


def test_opcheck():
    h = fnn.register(fnn.TorchBackend())  # a world of one: the real op is a matmul
    assert fnn.register(fnn.lookup(h)) == h
    a, w, bias = full_tensors(5, (6, 16), (24, 16), (24,))
    args = (a.requires_grad_(), w.requires_grad_().t(), bias.requires_grad_(), h, 1)
    torch.library.opcheck(torch.ops.flux_shmem.ag_gemm.default, args + (True,))
    frozen_b = (a, w.detach().t(), bias, h, 1)  # without the gathered input only a and bias get gradients
    torch.library.opcheck(torch.ops.flux_shmem.ag_gemm.default, frozen_b + (False,))
    torch.library.opcheck(torch.ops.flux_shmem.gemm_rs.default, args)
    torch.library.opcheck(torch.ops.flux_shmem.gemm_rs.default, (a, w.detach().t().contiguous(), None, h, 1))


def compile_recording(module):
    """torch.compile(module, fullgraph=True) through dynamo and AOTAutograd, run eagerly, and the list its forward
    and backward graphs are appended to as they are compiled."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    graphs = []

    def keep(g, _):
        graphs.append(g)
        return make_boxed_func(g)
    return torch.compile(module, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)), graphs


def test_compile_fullgraph_traces_the_layers():
    """torch.compile(fullgraph=True) through dynamo and AOTAutograd (fake kernels, autograd formulas): any graph
    break raises; the compiled forward and backward equal eager."""
    cfg = BlockConfig(hidden=32, heads=8, kv_heads=4, head_dim=4, ffn=48, bias=True)
    be = fnn.TorchBackend()
    torch.manual_seed(0)
    blk = TPBlock(cfg, backend=be, dtype=F64)
    x, gy = full_tensors(4, (8, 2, cfg.hidden), (8, 2, cfg.hidden))
    compiled, graphs = compile_recording(blk)
    outs = []
    for fn in (blk, compiled):
        blk.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_(True)
        y = fn(xs)
        y.backward(gy)
        outs.append((y.detach(), xs.grad, [p.grad.clone() for p in blk.parameters()]))
    (y0, gx0, g0), (y1, gx1, g1) = outs
    assert close(y1, y0) and close(gx1, gx0) and all(close(a, b) for a, b in zip(g1, g0))
    fw, bw = graphs  # one forward and one backward graph: no break
    fw_ops = [str(n.target) for n in fw.graph.nodes if n.op == "call_function"]
    bw_ops = [str(n.target) for n in bw.graph.nodes if n.op == "call_function"]
    assert fw_ops.count("flux_shmem.ag_gemm.default") == 2 and fw_ops.count("flux_shmem.gemm_rs.default") == 2
    assert bw_ops.count("flux_shmem.ag_gemm.default") == 2 and bw_ops.count("flux_shmem.gemm_rs.default") == 2
