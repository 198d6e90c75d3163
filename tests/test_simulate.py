"""The tile-level simulator (flux_shmem/ops/simulate.py): its GEMM work mapping, its event engine, and its
predictions for the fused ops, pinned on the Llama-3-70B tensor-parallel shard shapes at W = 2, 4, 8 and 2 nodes
x 8 with the default (assumed) H200 link model. A changed schedule or model shows up here first."""
from __future__ import annotations

import collections
import dataclasses

import pytest

from flux_shmem.plan import schedules as sch
from flux_shmem.plan import costs
from flux_shmem.plan import simulate as S
from flux_shmem.plan import search

RATE = 5.2  # TFLOP/s per SM (flux_shmem/ops/_fused.py TFLOPS_PER_SM)
M = 8192
FFN, HID = 28672, 8192  # Llama-3-70B


@pytest.mark.parametrize("tiles_m,tiles_n,sw,sms", [(64, 14, 1, 124), (64, 14, 8, 132), (7, 5, 4, 132),
                                                    (1, 1, 8, 132), (33, 3, 2, 16), (64, 32, 8, 2)])
def test_gemm_work_covers_every_tile_once_balanced(tiles_m, tiles_n, sw, sms):
    work = S.gemm_work(tiles_m, tiles_n, 2, sw, sms)
    rows = -(-tiles_m // 2)
    seen = collections.Counter((r, n) for items in work for r, n in items)
    assert seen == {(r, n): 1 for r in range(rows) for n in range(tiles_n)}  # no padding, nothing twice
    sizes = [len(w) for w in work]
    assert max(sizes) - min(sizes) <= 1 and len(work) <= sms // 2
    # a swizzle group of S cluster rows walks N together: the first S * tiles_n items are rows [0, S)
    S_ = max(1, min(sw, rows))
    first = sorted(it for c in range(len(work)) for i, it in enumerate(work[c]) if i * len(work) + c < S_ * tiles_n)
    assert {r for r, _ in first} == set(range(min(S_, rows)))


def test_swizzle_cost():
    """Narrow swizzle groups cost B re-reads (measured 2026-12-06, H100): modelled only where the Gemm asks for it
    and the GEMM has more cluster rows than a group."""
    g = costs.Gemm(tile_us=10.0, swizzle_cost=True)
    assert S.run_gemm(list(range(8)), 4, g, 1, 8)[1] == pytest.approx(40.0 * costs.SWIZZLE_COST[1])
    assert S.run_gemm(list(range(8)), 4, g, 4, 8)[1] == pytest.approx(40.0)  # 4 = every cluster row: one group
    assert costs.swizzle_cost(g, 8, 64) == 1.0 and costs.swizzle_cost(g, 2, 64) == costs.SWIZZLE_COST[2]
    assert costs.swizzle_cost(costs.Gemm(), 1, 64) == 1.0


def test_run_gemm_waits_and_waves():
    g = costs.Gemm(tile_us=10.0)
    ends, span = S.run_gemm(list(range(8)), 4, g, 1, 8)  # 16 cluster items on 4 clusters: 4 waves
    assert span == pytest.approx(40.0)
    ends, span = S.run_gemm(list(range(8)), 4, g, 1, 8, ready=lambda t: 100.0 if t >= 6 else 0.0)
    assert span == pytest.approx(110.0) and max(ends[7]) == pytest.approx(110.0)


def test_plan_deadlock_is_reported():
    ev = S._Events()
    with pytest.raises(RuntimeError, match="deadlock"):
        S._run_blocks([[["x"]]], lambda pe, it, t: (None, "never"), ev, 0.0)


def test_ag_arrivals_ring_shift_order():
    """One node: PE d receives shard d + 1 first (from PE d + 1, its step-1 target), then d + 2, ..."""
    arr, _ = S.ag_arrivals(4, 4, 1024, 16384, 64, 8)
    for d in range(4):
        last = [max(t for (s, c), t in arr[d].items() if s == (d + i) % 4) for i in range(1, 4)]
        assert last == sorted(last)
        assert max(t for (s, c), t in arr[d].items() if s == d) < last[0]  # my own copy first


def _ag(world, L, n, k, engine, cb, links=costs.Links()):
    g = costs.Gemm.from_rate(k, RATE)
    return S.simulate_ag_gemm(world=world, node_size=L, m=M, n=n, k=k, gemm=g, gemm_sms=search.gemm_sms_for(132, 2, cb),
                              all_sms=132, comm_blocks=cb, chunk_rows=sch.fused_chunk_rows(M // world, 2 * k, 128),
                              swizzle=1, links=links, engine=engine, pes=[0], decomposed_comm_blocks=16)


def _rs(world, L, n, k, cb, links=costs.Links()):
    g = costs.Gemm.from_rate(k, RATE)
    return S.simulate_gemm_rs(world=world, node_size=L, m=M, n=n, k=k, gemm=g, gemm_sms=search.gemm_sms_for(132, 2, cb),
                              all_sms=132, comm_blocks=cb, unit_rows=sch.default_unit_rows(n, 2), swizzle=1,
                              links=links, decomposed_comm_blocks=24)


# (world, node size, engine, comm blocks) -> (fused us, decomposed us, comm us): the up projection at TP = world
AG_PINNED = {
    (2, 2, "ce", 1): (2894, 3123, 233), (2, 2, "sm", 4): (3022, 3123, 233),
    (4, 4, "ce", 1): (1451, 1749, 303), (4, 4, "sm", 4): (1511, 1749, 303),
    (8, 8, "ce", 1): (754, 1062, 339), (8, 8, "sm", 8): (862, 1062, 339),
    (16, 8, "sm", 16): (502, 746, 333),
}
# (world, node size, comm blocks) -> (fused, decomposed, comm): the down projection at TP = world
RS_PINNED = {
    (2, 2, 4): (3066, 3135, 244), (4, 4, 4): (1556, 1745, 300), (8, 8, 4): (986, 1105, 382),
    (16, 8, 8): (609, 777, 416),
}
# (Re-pinned 2026-12-07 when Links.gemm_beside_comm went from 1.1 to 1.03 on that day's H100 runs: at W = 2 the
# SM engine's fused call, then slower than decomposed, is now a little faster.)
SM_LOSES: set = set()


@pytest.mark.parametrize("key", list(AG_PINNED))
def test_ag_gemm_predictions_pinned(key):
    world, L, engine, cb = key
    r = _ag(world, L, FFN // world, HID, engine, cb)
    assert (r.fused_us, r.decomposed_us, r.comm_us) == pytest.approx(AG_PINNED[key], rel=0.01)
    assert r.gemm_all_us <= r.fused_us and (r.fused_us < r.decomposed_us) == (key not in SM_LOSES)


@pytest.mark.parametrize("key", list(RS_PINNED))
def test_gemm_rs_predictions_pinned(key):
    world, L, cb = key
    r = _rs(world, L, HID, FFN // world, cb)
    assert (r.fused_us, r.decomposed_us, r.comm_us) == pytest.approx(RS_PINNED[key], rel=0.01)
    assert r.gemm_all_us <= r.fused_us and (r.fused_us < r.decomposed_us) == (key not in SM_LOSES)


def _choose(op, n, k):
    g = costs.Gemm.from_rate(k, RATE)
    if op == "ag_gemm":
        return search.plan_ag_gemm(world=8, node_size=8, m=M, n=n, k=k, elem_bytes=2, gemm=g, budget_sms=132,
                              chunk_rows=sch.fused_chunk_rows(M // 8, 2 * k, 128), engines=("ce", "sm"), pes=[0])
    return search.plan_gemm_rs(world=8, node_size=8, m=M, n=n, k=k, elem_bytes=2, gemm=g, budget_sms=132,
                          unit_rows=sch.default_unit_rows(n, 2))


@pytest.mark.parametrize("op,n,k,hidden", [
    ("ag_gemm", FFN // 8, HID, 0.91),           # up (or gate): 8192 x 3584 x 8192, comm 0.47x GEMM (copy engines)
    ("ag_gemm", (64 + 2 * 8) * 128 // 8, HID, None),  # QKV: 8192 x 1280 x 8192, comm 1.09x
    ("ag_gemm", 2 * FFN // 8, HID, None),       # gate+up fused: 8192 x 7168 x 8192, comm 0.23x
    ("gemm_rs", HID, FFN // 8, 0.71),           # down: 8192 x 8192 x 3584, comm 0.53x
    ("gemm_rs", HID, HID // 8, None),           # o_proj: 8192 x 8192 x 1024, comm 1.85x
])
def test_w8_llama70b(op, n, k, hidden):
    """The ops' own choices (engine, SM split, tail, reduce units) at W = 8, M = 8192 on the Llama-3-70B TP8 shard
    shapes: never slower than decomposed, and on the shapes whose communication is 0.3x to 1x the GEMM the share
    hidden is pinned, with the default H200 link model (40 GB/s per comm block over NVLink: on one H200 a block
    moves 30-38 GB/s between PEs, check comm_block_rates; real NVLink's is unmeasured here). AG+GEMM (copy engines)
    predicts 91%. GEMM+RS 71% (89% before the H100 runs of 2026-12-05 gave the model a GEMM 10% slower beside a
    comm kernel and a reduce unit's fixed cost of 5.5 us, 57% until those of 2026-12-07 took the GEMM's slowdown
    to 3%): 8 comm blocks, swizzle groups of 4 cluster rows with
    units 15 N-tiles wide and a tail. Both constants come from emulated runs, where W PEs share one GPU's L2 and
    memory; what they are on NVLink-connected GPUs is for the first multi-GPU run to say."""
    split, r = _choose(op, n, k)
    ratio = r.comm_us / r.gemm_all_us
    assert r.fused_us < r.decomposed_us, (split, r.as_dict())
    assert (0.3 <= ratio <= 1.0) == (hidden is not None), ratio
    if hidden is not None:
        assert r.hidden == pytest.approx(hidden, abs=0.01), (split, ratio, r.as_dict())
    if op == "gemm_rs" and hidden is not None:
        assert (split.comm_blocks, split.swizzle, split.group_tiles) == (8, 4, 15), split


def test_rs_shapes_and_last_wave():
    """The (swizzle, width) pairs: a wave of C clusters covers C // S N-tiles of S cluster rows; whole rows at
    S = 1. The last wave's pieces: with 64 clusters over 32 cluster rows x 32 N-tiles, whole rows one row at a time
    leave 4 M-tiles (2 cluster rows); 4-row groups of half rows leave 8 M-tiles' second halves."""
    # every swizzle with whole rows too (fewer B re-reads than swizzle 1: SWIZZLE_COST)
    assert search.rs_shapes(64, 32, 2, 64) == [(1, 32), (2, 32), (4, 16), (4, 32), (8, 8), (8, 32)]
    assert search.rs_shapes(64, 32, 2, 30) == [(1, 32), (2, 15), (2, 32), (4, 7), (4, 32), (8, 3), (8, 32)]
    assert search.rs_shapes(4, 32, 2, 62) == [(1, 32), (2, 31), (2, 32)]  # no swizzle wider than the 2 cluster rows
    # A given swizzle (FLUX_SHMEM_GEMM_CONFIG): whole rows or one wave's width, with that swizzle only
    assert search.rs_shapes(64, 32, 2, 30, swizzle=8) == [(8, 32), (8, 3)]
    assert search.rs_shapes(64, 32, 2, 30, swizzle=1) == [(1, 32), (1, 30)]
    assert search.rs_shapes(4, 32, 2, 30, group_tiles=5, swizzle=8) == [(2, 5)]  # clamped to the cluster rows
    assert search.rs_last_wave(64, 32, 2, 1, 32, 64) == 4
    assert search.rs_last_wave(64, 32, 2, 4, 16, 64) == 8
    assert search.rs_last_wave(3, 5, 2, 1, 5, 100) == 3  # everything is in the one wave


def test_column_groups_spread_the_last_wave():
    """W = 8, Llama-3-70B down at M = 8192: the same split with half-row units in 4-row swizzle groups ends every
    owner at about the same time, where whole rows one row at a time leave the last wave's owners behind; but on 4
    comm blocks its twice as many units cost more than that gains (the fixed cost per unit, measured on an H100
    2026-12-05: 2 blocks on units 7 N-tiles wide ran 0.60x of decomposed where whole rows ran 1.15x)."""
    g = costs.Gemm.from_rate(FFN // 8, RATE)
    kw = dict(world=8, node_size=8, m=M, n=HID, k=FFN // 8, gemm=g, gemm_sms=128, all_sms=132, comm_blocks=4,
              unit_rows=8, decomposed_comm_blocks=24)
    rows = S.simulate_gemm_rs(**kw)
    spread = S.simulate_gemm_rs(**kw, swizzle=4, group_tiles=16)
    assert spread.gemm_us == rows.gemm_us
    ends = spread.detail["reduce_end_us"]
    assert max(ends) - min(ends) < 0.25 * (max(rows.detail["reduce_end_us"]) - min(rows.detail["reduce_end_us"]))
    assert spread.fused_us > rows.fused_us


# Measured 2026-12-05 on one H100 (benchmarks/RESULTS.md, this session's calls 2 and 3): W PEs under MPS, each in a
# green context of 128 / W SMs, NVLink emulated at 360 GB/s x SMs / 132. GEMM+RS rows of call 2 have whole-row units
# (the reduce kernel before 0ac97cd, whose passes only cost more on narrow units); the others ran 0ac97cd's kernel.
EMULATED_RUNS = [  # W, op, M, N, K per PE, comm blocks, GEMM SMs, swizzle, unit width (0: whole rows), tail pieces,
    #                gemm_only ms on all SMs, measured fused ms
    (2, "ag_gemm", 8192, 3584, 8192, 2, 62, 1, 0, 0, 1.259, 1.455),
    (2, "ag_gemm", 4096, 3584, 8192, 2, 62, 1, 0, 0, 0.628, 0.773),
    (2, "ag_gemm", 8192, 1280, 8192, 8, 56, 1, 0, 0, 0.443, 0.624),
    (4, "ag_gemm", 8192, 3584, 8192, 2, 30, 1, 0, 0, 2.863, 3.471),
    (4, "ag_gemm", 4096, 3584, 8192, 2, 30, 1, 0, 0, 1.402, 1.710),
    (4, "ag_gemm", 8192, 1280, 8192, 4, 28, 1, 0, 0, 0.925, 1.425),
    (2, "gemm_rs", 8192, 8192, 3584, 8, 56, 1, 0, 2, 1.289, 1.764),
    (2, "gemm_rs", 4096, 8192, 3584, 8, 56, 2, 14, 0, 0.644, 0.893),
    (2, "gemm_rs", 8192, 8192, 1024, 16, 48, 2, 12, 0, 0.428, 0.862),
    (2, "gemm_rs", 8192, 8192, 3584, 16, 48, 2, 12, 0, 1.288, 1.856),
    (4, "gemm_rs", 8192, 8192, 3584, 2, 30, 2, 7, 18, 3.078, 4.872),  # 2 blocks on narrow units: 0.60x before 0ac97cd
    (4, "gemm_rs", 4096, 8192, 3584, 2, 30, 2, 7, 18, 1.502, 2.335),
    (4, "gemm_rs", 8192, 8192, 1024, 8, 24, 2, 6, 0, 1.069, 1.666),
    (4, "gemm_rs", 8192, 8192, 3584, 2, 30, 1, 0, 2, 3.075, 3.696),
    (4, "gemm_rs", 4096, 8192, 3584, 2, 30, 1, 0, 2, 1.501, 1.902),
    (4, "gemm_rs", 8192, 8192, 3584, 8, 24, 1, 0, 0, 3.079, 4.123),
    (4, "gemm_rs", 4096, 8192, 3584, 8, 24, 1, 0, 0, 1.502, 2.077),
    (4, "gemm_rs", 8192, 8192, 1024, 8, 24, 1, 0, 0, 1.091, 1.706),
]


def _emulated(run):
    W, op, m, n, k, cb, gs, sw, gt, tail, gemm_ms, _ = run
    sms = 128 // W
    waves = -(-(-(-m // 256) * -(-n // 256)) // (sms // 2))  # 128x256 tiles in clusters of 2 on sms // 2 clusters
    g = costs.Gemm(tile_us=gemm_ms * 1e3 / waves)  # the measured GEMM: the test is of the overlap model
    links = costs.emulated_links(360.0 * sms / 132, 1.5)
    if op == "ag_gemm":
        return S.simulate_ag_gemm(world=W, node_size=W, m=m, n=n, k=k, gemm=g, gemm_sms=gs, all_sms=sms,
                                  comm_blocks=cb, chunk_rows=sch.fused_chunk_rows(m // W, 2 * k, 128), swizzle=sw,
                                  links=links, pes=[0], decomposed_comm_blocks=16)
    return S.simulate_gemm_rs(world=W, node_size=W, m=m, n=n, k=k, gemm=g, gemm_sms=gs, all_sms=sms, comm_blocks=cb,
                              unit_rows=sch.default_unit_rows(n, 2), swizzle=sw, group_tiles=gt or None, links=links,
                              decomposed_comm_blocks=24, tail=tail, tail_blocks=sms)


@pytest.mark.parametrize("run", EMULATED_RUNS, ids=lambda r: f"{r[1]}-w{r[0]}-{r[2]}x{r[3]}x{r[4]}-cb{r[5]}-u{r[8]}")
def test_reproduces_measured_emulated_runs(run):
    """The simulator against the emulated runs, with their splits and the measured GEMM speed: within 15% (issue
    10's bar, and issue 27's: the 0.60x run, a reduce kernel of 2 blocks on units 7 N-tiles wide, was predicted
    24% fast by the model of the time, which had no fixed cost per unit worth the name). Errors were -10% to +12%."""
    err = (_emulated(run).fused_us / 1e3 - run[-1]) / run[-1]
    assert abs(err) <= 0.15, err


def test_too_few_reduce_blocks_are_seen():
    """The case of issue 27: 2 reduce blocks on narrow units end long after the GEMM, and the model says so (its
    reduce ends > 1.3x after the GEMM, fused slower than whole rows on the same 2 blocks, as measured: 4.87 vs
    3.70 ms)."""
    narrow = _emulated(EMULATED_RUNS[10])
    whole = _emulated(EMULATED_RUNS[13])
    assert max(narrow.detail["reduce_end_us"]) > 1.3 * narrow.gemm_us
    assert narrow.fused_us > 1.2 * whole.fused_us


def test_emulated_link_model_paces_initiators_only():
    em = costs.emulated_links(90.0, 2.0)
    assert not em.model_ingress and em.nvlink_gbps == em.ib_gbps == 90.0
    arr, ends = S.ag_arrivals(2, 2, 1024, 16384, 64, 4, em)
    # 16 MiB per PE over a 90 GB/s paced link: about 186 us, plus a per-transfer latency (4 blocks at 35 GB/s each
    # keep up with the link)...
    assert max(ends) == pytest.approx(1024 * 16384 / 90e3 + 16 * 2.0, rel=0.1)
    # ...2 blocks do not: 70 GB/s of copies
    _, ends2 = S.ag_arrivals(2, 2, 1024, 16384, 64, 2, em)
    assert max(ends2) == pytest.approx(1024 * 16384 / 70e3, rel=0.15)


def test_puts_to_mapped_peers_keep_their_block_busy():
    """Forced puts on one node go through NVSHMEM's P2P transport, a copy by the issuing block: with put_by_blocks
    one gather block cannot carry the link, and the planner takes more (seen 2026-12-04: it took 1, at 15 GB/s)."""
    g = costs.Gemm.from_rate(8192, 6.0)
    kw = dict(world=2, node_size=1, m=8192, n=3584, k=8192, elem_bytes=2, gemm=g, budget_sms=64,
              chunk_rows=sch.fused_chunk_rows(4096, 2 * 8192, 128))
    nic = costs.emulated_links(174.5, 1.5)
    p2p = dataclasses.replace(nic, put_by_blocks=True)
    one = dict(kw, comm_blocks=1)
    assert search.plan_ag_gemm(**one, links=p2p)[1].fused_us > 1.5 * search.plan_ag_gemm(**one, links=nic)[1].fused_us
    assert search.plan_ag_gemm(**kw, links=p2p)[0].comm_blocks > 1
