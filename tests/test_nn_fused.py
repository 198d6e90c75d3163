"""FusedBackend's pool on the CPU: ops built once per shape family for the largest M seen and grown collectively
(stand-in op classes, a stand-in runtime), disagreement between PEs, the fallback reported once, operand checks."""
from __future__ import annotations

import warnings

import pytest
import torch

import flux_shmem
from flux_shmem.nn import fused
from flux_shmem.runtime import state
from flux_shmem.runtime.topology import Layout


class Host:
    """Host collectives of PE `rank`; `others` is what the other PEs contribute to every allgather."""

    name = "test"

    def __init__(self, rank=0, size=2, others=None):
        self.rank, self.size, self.others, self.gathered = rank, size, others, []

    def allgather(self, obj):  # (collective.exchange sends (status, value))
        status, value = obj
        self.gathered.append(value)
        theirs = value if self.others is None else self.others(value)
        return [obj] + [(status, theirs)] * (self.size - 1)

    def barrier(self):
        pass

    def barrier_within(self, timeout_s):
        return True


class StandInOp:
    built: list = []

    def __init__(self, max_m, n, k, dtype, mode="auto", **kw):
        self.max_m, self.n, self.k, self.mode, self.kw = max_m, n, k, mode, kw
        StandInOp.built.append((type(self).__name__, max_m, n, k))


class AG(StandInOp):
    pass


class RS(StandInOp):
    pass


@pytest.fixture
def runtime(monkeypatch):
    import flux_shmem.ops.ag_gemm as ag_mod
    import flux_shmem.ops.gemm_rs as rs_mod
    monkeypatch.setattr(ag_mod, "AllGatherGEMM", AG)
    monkeypatch.setattr(rs_mod, "GEMMReduceScatter", RS)
    StandInOp.built = []

    def make(world=2, others=None):
        host = Host(0, world, others)
        rt = state.Runtime(host=host, layout=Layout(0, world, 0, world, 0, 1), device=0, node_size=world,
                           reachable=(True,) * world, force_put=False, timeout_s=5.0, trap_on_timeout=True,
                           shares_gpu=False)
        state.set_runtime(rt)
        return rt
    yield make
    state.set_runtime(None)


def test_grown_max_m():
    assert fused.grown_max_m(100, 2) == 128          # 50 rows per PE -> 64
    assert fused.grown_max_m(8, 4) == 8 and fused.grown_max_m(9, 4) == 16
    assert fused.grown_max_m(6144, 2, min_m=6144) == 6144   # a given size is taken as is
    assert fused.grown_max_m(6000, 3, min_m=6001) == 6003   # ... rounded up to the world
    assert fused.grown_max_m(7000, 2, min_m=6144, old=6144) == 12288  # past it: at least doubles
    assert fused.grown_max_m(130, 2, old=128) == 256


def test_pool_builds_once_per_shape_and_grows(runtime):
    runtime(world=2)
    be = fused.FusedBackend(mode="fused", engine="ce")
    dt = torch.bfloat16
    a = be.op("ag_gemm", 100, 64, 32, dt)
    assert (a.max_m, a.n, a.k, a.mode, a.kw) == (128, 64, 32, "fused", {"engine": "ce"})
    assert be.op("ag_gemm", 128, 64, 32, dt) is a and be.op("ag_gemm", 2, 64, 32, dt) is a
    r = be.op("gemm_rs", 100, 64, 32, dt)           # another kind: another op
    assert isinstance(r, RS) and "engine" not in r.kw
    assert be.op("ag_gemm", 64, 32, 64, dt) is not a  # another shape: another op
    bigger = be.op("ag_gemm", 130, 64, 32, dt)
    assert bigger is not a and bigger.max_m == 256 and be.ops()[("ag_gemm", 64, 32, dt)] is bigger
    assert [b[:2] for b in StandInOp.built] == [("AG", 128), ("RS", 128), ("AG", 64), ("AG", 256)]
    # every build was agreed on first: the size went through the host collectives
    host = state.get_runtime().host
    assert host.gathered == [128, 128, 64, 256]
    assert "ag_gemm(n=64, k=32, max_m=256)" in repr(be)


def test_pool_with_max_m_builds_once(runtime):
    runtime(world=4)
    be = fused.FusedBackend(max_m=6000)
    assert be.op("gemm_rs", 8, 16, 16, torch.float16).max_m == 6000
    assert be.op("gemm_rs", 6000, 16, 16, torch.float16).max_m == 6000
    assert len(StandInOp.built) == 1


def test_pes_that_disagree_on_m_raise_together(runtime):
    runtime(world=2, others=lambda v: v * 2)  # the other PE saw twice as many rows
    be = fused.FusedBackend()
    with pytest.raises(flux_shmem.SymmetricMismatchError, match="every PE must pass the same M"):
        be.op("ag_gemm", 100, 64, 32, torch.bfloat16)
    assert StandInOp.built == []


def test_fallback_is_reported_once_and_exact(runtime):
    runtime(world=1)
    be = fused.FusedBackend()
    a, w = torch.randn(4, 16), torch.randn(24, 16)
    with pytest.warns(UserWarning, match="torch.distributed.*tensors on cpu"):
        out, gathered = be.ag_gemm(a, w.t(), None, True)
    assert torch.allclose(out, a @ w.t()) and torch.equal(gathered, a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: silent
        assert torch.allclose(be.gemm_rs(a, w.t(), None), a @ w.t())
    assert StandInOp.built == []


def test_fallback_without_torch_distributed_names_the_fix(runtime):
    runtime(world=2)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="init_process_group"):
        fused.FusedBackend().gemm_rs(torch.randn(4, 16), torch.randn(16, 8), None)


def test_unsupported_reasons():
    bf, fp = torch.bfloat16, torch.float16
    assert fused.why_unsupported("cuda", (bf, bf, bf), 4096, 1024) is None
    assert fused.why_unsupported("cuda", (fp, fp), 8, 8) is None
    assert "on cpu" in fused.why_unsupported("cpu", (bf, bf), 8, 8)
    assert "float32" in fused.why_unsupported("cuda", (torch.float32, torch.float32), 8, 8)
    assert "bfloat16, torch.float16" in fused.why_unsupported("cuda", (bf, fp), 8, 8)
    assert "K = 12" in fused.why_unsupported("cuda", (bf, bf), 12, 8)
    assert "N = 4" in fused.why_unsupported("cuda", (bf, bf), 8, 4)
    a = torch.empty(4, 16, dtype=torch.bfloat16)
    assert "on cpu" in fused.unsupported(a, torch.empty(16, 8, dtype=torch.bfloat16), None)


def test_b_operand_keeps_a_transposed_weight_transposed():
    w = torch.randn(24, 16)
    b = fused._b_operand(w.t())
    assert b.data_ptr() == w.data_ptr() and b.t().is_contiguous()
    odd = torch.randn(8, 16)[:, 1:9]      # neither layout: made row-major
    assert fused._b_operand(odd).is_contiguous()
