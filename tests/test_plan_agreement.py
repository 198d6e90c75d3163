"""Issue 27: the fused ops' call plans are the same on every PE. Peers read each other's chunks, tiles and units by
the plan, so a PE that planned another engine, split or GEMM configuration hangs the call (seen in review:
AllGatherGEMM planned on each PE's own view, and 7 of 168 M values gave PEs of one node different engines).

Plans are `plan.call.plan_call(inputs, m, layout, rank)` (issue 25: decided per bucket of M by the fast model): the
rank only picks the PE's own M-tile order out of the plan; the inputs are agreed at construction
(`symmetric.agree`), so a PE built with other inputs raises there."""
from __future__ import annotations

import dataclasses

import pytest

from flux_shmem.errors import SymmetricMismatchError
from flux_shmem.plan import costs
from flux_shmem.plan import call
from flux_shmem.plan import offline
from flux_shmem.runtime import symmetric

inputs = offline.inputs  # (what an op built with these arguments on one 132-SM GPU per PE agrees on)


def shared(plan: call.CallPlan) -> tuple:
    """Every field of a plan that peers depend on (all but the PE's own tile order and the prediction)."""
    return (plan.path, plan.engine, plan.comm_blocks, plan.gemm_sms, plan.swizzle, plan.tail, plan.tail_blocks,
            plan.group_tiles, plan.gemm)


def m_values(world: int, count: int, top: int) -> list[int]:
    """`count` distinct multiples of the world size up to `top`: every small M, then geometric steps (tile- and
    shard-misaligned ones included: those are where PEs' views of the arrivals differ most)."""
    small = min(count // 3, 64)
    out = [world * (i + 1) for i in range(small)]
    ratio = (top / out[-1]) ** (1 / (count - small))
    while len(out) < count:
        out.append(max(out[-1] + world, int(out[-1] * ratio) // world * world))
    assert len(set(out)) == count and max(out) <= top, (max(out), top)
    return out


@pytest.mark.parametrize("world,node_size", [(4, 4), (8, 8), (16, 8)])
def test_ag_gemm_every_rank_plans_alike(world, node_size):
    """AllGatherGEMM, the QKV and up-projection shards of Llama-3-70B at TP = world: 200 M values (8 ... 28k
    rows), every rank's plan identical but for its own tile order, which is a permutation of the M-tiles."""
    for n in (1280 * 8 // world, 28672 // world):
        inp = inputs("ag_gemm", world, node_size, n, 8192, 32768)
        for m in m_values(world, 200, 32768):
            plans = [call.plan_call(inp, m, "nk", r) for r in range(world)]
            assert len({shared(p) for p in plans}) == 1, (world, n, m, [shared(p) for p in plans])
            tiles = -(-m // 128)
            for p in plans:
                assert p.order is None or sorted(p.order) == list(range(tiles))


@pytest.mark.parametrize("world,node_size", [(4, 4), (8, 8), (16, 8)])
def test_gemm_rs_every_rank_plans_alike(world, node_size):
    """GEMMReduceScatter (the down projection's shard, with the planner's own comm blocks and unit widths, and with
    those an op given them builds): 200 M values, every rank's plan identical but for its own tile order, which is
    a permutation of the M-tiles."""
    for kw in ({}, dict(comm_blocks=8, group_tiles=64)):
        inp = inputs("gemm_rs", world, node_size, 8192, 28672 // world, 65536, **kw)
        for m in m_values(world, 200, 65536):
            plans = [call.plan_call(inp, m, "nk", r) for r in range(world)]
            assert len({shared(p) for p in plans}) == 1, (world, m, kw)
            for p in plans:
                assert p.order is None or sorted(p.order) == list(range(-(-m // 128)))


def test_review_cases_plan_alike():
    """The review's cases at W = 8 on one node (max_m 8192, n 3584, k 8192, M = 512 and 1536: 'ce' on some PEs,
    'sm' on others; n 1280, M = 2560: fused on some, decomposed on others), with every candidate searched."""
    for n, ms in ((3584, (512, 1536)), (1280, (2560,))):
        inp = inputs("ag_gemm", 8, 8, n, 8192, 8192)
        for m in ms:
            assert len({shared(call.plan_call(inp, m, "nk", r)) for r in range(8)}) == 1, (n, m)


class _Host:
    """Host collectives of a job whose PEs pass `values` (this PE is PE `rank`)."""

    def __init__(self, values, rank=0):
        self.values, self.rank = values, rank

    def barrier_within(self, timeout_s):
        return True

    def allgather(self, obj):  # (collective.exchange sends (status, value))
        assert obj == ("ok", self.values[self.rank])
        return [("ok", v) for v in self.values]


@pytest.mark.parametrize("change", [dict(budget_sms=66), dict(links=costs.emulated_links(87.3, 1.5)),
                                    dict(links=dataclasses.replace(costs.Links(), put_by_blocks=True)),
                                    dict(forced=(("config", "128x128_c2x1"),)), dict(engines=("sm",))])
def test_mismatched_inputs_raise_at_construction(change):
    """Two PEs whose inputs differ (another MPS share, link emulation on one PE only, FLUX_SHMEM_GEMM_CONFIG on one
    only, ...): the op's construction-time check raises on every PE and names each PE's value."""
    mine = inputs("ag_gemm", 2, 2, 3584, 8192, 8192)
    theirs = dataclasses.replace(mine, **change)
    for rank in (0, 1):
        with pytest.raises(SymmetricMismatchError, match=r"PE 0: .*PE 1: "):
            symmetric.agree("AllGatherGEMM's planner inputs", [mine, theirs][rank], host=_Host([mine, theirs], rank),
                            timeout_s=1.0)
    symmetric.agree("AllGatherGEMM's planner inputs", mine, host=_Host([mine, mine]), timeout_s=1.0)
