"""GPU checks, group emulation: link pacing, comm block rates, the fused GEMM's costs, persistent grids, SM
partitions and MPS concurrency (informational notes where nothing can fail)."""
from __future__ import annotations

import os

import torch

import flux_shmem
from common import Skip, check, gathered_inputs, rel_err
from gemm_checks import per_call_ms, shard_gemms


@check("emulation")
def link_emulation_paces(rt):
    """FLUX_SHMEM_LINK_GBPS paces the all-gather: moving B bytes to my peers takes at least B / rate."""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    os.environ["FLUX_SHMEM_LINK_GBPS"] = "20"
    try:
        ag = flux_shmem.AllGather(2048, 4096, torch.bfloat16, comm_blocks=4)
    finally:
        os.environ.pop("FLUX_SHMEM_LINK_GBPS", None)
    xs = gathered_inputs(rt, (2048, 4096), torch.bfloat16, 31)
    ag(xs[rt.rank])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flux_shmem.barrier()
    start.record()
    out = ag(xs[rt.rank])
    end.record()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat(xs)), "paced all-gather wrong"
    sent = (W - 1) * 2048 * 4096 * 2
    ms = start.elapsed_time(end)
    floor = sent / 20e9 * 1e3
    if rt.rank == 0:
        print(f"CHECK info: paced all-gather of {sent / 1e6:.0f} MB to peers in {ms:.2f} ms (floor {floor:.2f} ms "
              "at 20 GB/s)", flush=True)
    assert ms >= 0.95 * floor, f"pacing too fast: {ms:.3f} ms < {floor:.3f} ms"



@check("emulation")
def comm_block_rates(rt):
    """How fast one comm thread block moves data here (no pacing): the simulator's block rate comes from this.
    Prints GB/s per block for the all-gather (stores into the peer's buffer) and the reduce-scatter (loads of every
    node PE's addend, one store) with 1, 2 and 4 blocks, and checks both results. (A bulk-copy ring through shared
    memory, cp.async.bulk, measured the same rates, 2026-12-04: the per-SM copy rate is the limit, not bytes in
    flight.)"""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    rows, cols = 4096, 8192
    xs = gathered_inputs(rt, (rows, cols), torch.bfloat16, 41)
    for blocks in (1, 2, 4):
        ag = flux_shmem.AllGather(rows, cols, torch.bfloat16, comm_blocks=blocks, chunk_rows=64)
        rs = flux_shmem.ReduceScatter(rows * W, cols, torch.bfloat16, comm_blocks=blocks)
        buf = rs.input_buffer(rows * W)
        buf.copy_(torch.cat(xs))
        res = []
        for name, fn, nbytes in (("all-gather", lambda: ag(xs[rt.rank], copy=False), (W - 1) * rows * cols * 2),
                                 ("reduce-scatter", lambda: rs(buf), (W + 1) * rows * cols * 2)):
            out = fn().clone()
            torch.cuda.synchronize()
            flux_shmem.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 5
            res.append(f"{name} {nbytes / ms / 1e6 / blocks:.0f} GB/s per block ({ms:.3f} ms)")
            # every PE's input is cat(xs): the gather is cat(xs), PE r's reduced rows are W * xs[r]
            if name == "all-gather":
                assert torch.equal(out, torch.cat(xs)), f"all-gather, {blocks} block(s)"
            else:
                err = rel_err(out, W * xs[rt.rank].float())
                assert err < 1e-2, f"reduce-scatter, {blocks} block(s): rel. error {err}"
        if rt.rank == 0:
            print(f"CHECK info: {blocks} block(s): " + "; ".join(res), flush=True)
        flux_shmem.barrier()
    beside_gemm_rates(rt, rows, cols, xs)


def beside_gemm_rates(rt, rows, cols, xs):
    """The all-gather's GB/s per block while a GEMM runs on the other SMs of the budget, as in a fused call (a
    gather block moved ~25 GB/s there against ~35 alone, 2026-12-04, read off the fused calls' stage times)."""
    W = rt.world_size
    m, n, k = 16384, 3584, 8192  # a GEMM longer than the gather (inputs ready: the side stream waits for nothing)
    g = torch.Generator(device="cuda").manual_seed(5 + rt.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g).t()
    op = flux_shmem.AllGatherGEMM(m * W, n, k, torch.bfloat16, mode="decomposed")
    from flux_shmem.plan import search
    from flux_shmem.runtime import partition
    side = partition.side_stream(rt.device)  # in this PE's green context, like a fused call's comm stream
    res = []
    for blocks in (2, 4):
        ag = flux_shmem.AllGather(rows, cols, torch.bfloat16, comm_blocks=blocks, chunk_rows=64)
        gemm_sms = search.gemm_sms_for(op.sms, op.cluster_m, blocks)  # as a fused call splits its budget
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            flux_shmem.barrier()
            op.gemm_only(a, b, sm_count=gemm_sms)  # first, so that the gather's blocks take the SMs left over
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start.record()
                ag(xs[rt.rank], copy=False)
                end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
        res.append(f"{blocks} blocks {(W - 1) * rows * cols * 2 / ms / 1e6 / blocks:.0f} GB/s per block ({ms:.3f} ms)")
    if rt.rank == 0:
        print("CHECK info: all-gather beside a GEMM on the other SMs: " + "; ".join(res), flush=True)
    flux_shmem.barrier()


@check("emulation")
def fused_gemm_costs(rt):
    """Informational: what slows the GEMM inside a fused GEMM+RS call. The TP8 down-projection shard
    8192 x 8192 x 3584 on the fused call's GEMM SMs, interleaved in rounds (clock and power drift hit all alike):
    our gemm_only (its own configuration and swizzle); the fused call's configuration plain, with the M-tile
    counters its epilogue raises, with the fused M-tile order, with both (and swizzle 4); and the GEMM stage of the
    real fused call (the reduce kernel beside it). The GEMM-only variants run on a second, throwaway op (they
    leave its counters off the epoch). 2026-12-04: the counters cost 5% with two system fences per tile, nothing
    with one."""
    from benchmarks import metrics
    from flux_shmem.runtime import stall
    if rt.world_size == 1:
        raise Skip("needs 2 or more PEs")
    m, n, k = 8192, 8192, 3584
    g = torch.Generator(device="cuda").manual_seed(77 + rt.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g).t()
    op = flux_shmem.GEMMReduceScatter(m, n, k, torch.bfloat16, mode="fused")
    scratch = flux_shmem.GEMMReduceScatter(m, n, k, torch.bfloat16, mode="fused")
    plan = op.call_plan(m, "nk")

    def fused_stage(calls: int) -> list:
        marks = []
        for _ in range(calls):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            with stall.timed_stages() as traced:
                op(a, b)
            marks.append((start, traced[0]))
        torch.cuda.synchronize()
        return [metrics.fused_gemm_ms(stall.stage_offsets_ms(tr, start)) for start, tr in marks]

    def raw(counters, order, swizzle=plan.swizzle):
        return lambda: scratch._gemm("nk", a, b, scratch.engine.partial.data_ptr(), None, m, counters=counters,
                                     sm_count=plan.gemm_sms, order=plan.order if order else None,
                                     swizzle=swizzle, choice=plan.gemm)
    variants = {"gemm_only": lambda: op.gemm_only(a, b, sm_count=plan.gemm_sms), "plain": raw(False, False),
                "counters": raw(True, False), "order": raw(False, True), "counters+order": raw(True, True),
                "counters+order swizzle 4": raw(True, True, 4), "fused call's GEMM stage": None}
    samples = {name: [] for name in variants}
    for rnd in range(6):
        for name in (list(variants) if rnd % 2 == 0 else list(variants)[::-1]):
            flux_shmem.barrier()
            if variants[name] is None:
                fused_stage(1)  # warm-up after the switch
                samples[name] += fused_stage(4)
            else:
                variants[name]()
                samples[name] += per_call_ms(variants[name], lambda: None, 4)
    out = {name: sorted(ts)[len(ts) // 2] for name, ts in samples.items()}
    if rt.rank == 0:
        base = out["gemm_only"]
        print(f"CHECK info: GEMM+RS {m}x{n}x{k} on {plan.gemm_sms} CTAs ({plan.gemm.config}, swizzle {plan.swizzle}; "
              f"gemm_only: {op.gemm_choice(m, 'nk', plan.gemm_sms).describe()}): "
              + "; ".join(f"{k_} {v:.3f} ms ({v / base:.3f}x)" for k_, v in out.items()), flush=True)
    flux_shmem.barrier()




@check("emulation")
def persistent_grid_slack(rt):
    """Informational: our persistent GEMM per call after a host sync + barrier (the benchmark's protocol on a
    shared GPU), against cuBLAS. Under MPS its median was about twice its minimum while cuBLAS's was not, and 2 or
    4 SMs of slack in the grid did not change that reliably, nor did other configurations, an unclustered
    128x256 build included (2026-12-03, benchmarks/RESULTS.md fourth session): one PE's grid runs as a grid of half
    its size would. The variants stay as the measurement of that."""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    (m, n, k), op, fns = shard_gemms(rt, 17)
    from benchmarks import timing as flux_timing
    g = torch.Generator(device="cuda").manual_seed(23 + rt.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    from flux_shmem.kernels import config as kconfig, plain

    def forced(cfg: str, sms: int):
        c = kconfig.choose(m, n, k, torch.bfloat16, "nk", sms)
        c = kconfig.Choice(cfg, c.swizzle if cfg == c.config else 1, 1, "forced", "persistent_grid_slack")
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        return lambda: plain.gemm(a, w.t(), out=out, choice=c, sm_count=sms)

    S = op.sms
    # (name, fn, extra GPU lead of PE r in us: r * stagger)
    variants = [("cuBLAS", lambda: a @ w.t(), 0), (f"ours {S} CTAs", lambda: op.gemm_only(a, w.t()), 0),
                (f"ours {S} CTAs, PEs staggered 400 us", lambda: op.gemm_only(a, w.t()), 400),
                (f"ours {S - 4} CTAs", lambda: op.gemm_only(a, w.t(), sm_count=S - 4), 0),
                (f"ours {S // 2} CTAs", lambda: op.gemm_only(a, w.t(), sm_count=S // 2), 0),
                (f"ours 128x128_c2x1_pp {S} CTAs", forced("128x128_c2x1_pp", S), 0),
                (f"ours 256x128_c1x2 {S} CTAs", forced("256x128_c1x2", S), 0)]
    for name, fn, stagger in variants:
        fn()

        def before(stagger=stagger):
            torch.cuda.synchronize()
            rt.host.barrier()
            # ~1 ms of GPU lead: the host enqueues the call before the GPU reaches it
            flux_timing.gpu_sleep(1000 + stagger * rt.rank)
        ms = per_call_ms(fn, before, 16)
        meds, mins = rt.host.allgather(ms[len(ms) // 2]), rt.host.allgather(ms[0])
        if rt.rank == 0:
            print(f"CHECK note: {name} {m}x{n}x{k} per call after host sync + barrier + GPU lead: median "
                  f"{' / '.join(f'{x:.3f}' for x in meds)} ms (per PE), min {min(mins):.3f} ms (budget "
                  f"{op.budget.sms} SMs, {op.budget.source})", flush=True)


_SM_IDS_SRC = r"""
extern "C" __global__ void fs_sm_ids(unsigned int* out, long long spin) {
  unsigned int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  if (threadIdx.x == 0) out[blockIdx.x] = id;
}
"""


@check("emulation")
def sm_partition(rt):
    """How many SMs each PE's kernels run on while all PEs run at once: a kernel of many short blocks records
    %smid per block; in a green context (FLUX_SHMEM_SM_PARTITION=green) no more than the context's count. Under
    MPS %smid is virtual (2026-12-03: two clients at 50% both saw SMs 0..65, and both green contexts 0..63), so
    this cannot show whether the PEs' SMs are disjoint; persistent_grid_slack and mps_concurrency show it by time
    (with green contexts neither PE's persistent grid lost half its speed, and the PEs ran at once at x0.92-1.11
    of alone)."""
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, Stream, launch
    from flux_shmem.runtime import partition
    part = partition.active(rt.device)
    dev = Device(rt.device)
    arch = "sm_" + "".join(str(x) for x in dev.compute_capability)
    kern = Program(_SM_IDS_SRC, code_type="c++", options=ProgramOptions(arch=arch)).compile("cubin") \
        .get_kernel("fs_sm_ids")
    blocks = 4096
    out = torch.full((blocks,), -1, dtype=torch.int32, device="cuda")
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    clock_hz = 1.98e9
    import numpy as np
    torch.cuda.synchronize()
    rt.host.barrier()
    launch(stream, LaunchConfig(grid=blocks, block=128), kern, out.data_ptr(), np.int64(int(20e-6 * clock_hz)))
    torch.cuda.synchronize()
    ids = out.cpu().tolist()
    assert all(0 <= i < 1024 for i in ids), f"PE {rt.rank}: a block recorded no SM id"
    mine = sorted(set(ids))
    sets = rt.host.allgather(mine)
    if rt.rank == 0:
        desc = "; ".join(f"PE {pe}: {len(s)} SMs [{s[0]}..{s[-1]}]" for pe, s in enumerate(sets))
        print(f"CHECK note: sm_partition ({part.describe() if part else 'no partition'}): {desc} (SM ids as the "
              "context sees them: virtual under MPS)", flush=True)
    if part is not None:
        assert len(mine) <= part.sms, f"PE {rt.rank}: ran on {len(mine)} SMs, its green context has {part.sms}"


@check("emulation")
def mps_concurrency(rt):
    """Whether PEs sharing this GPU really run at once on separate SMs: the same GEMM (cuBLAS, and our persistent
    gemm_only on the whole SM budget), timed on each PE alone and on all PEs at once. Disjoint SMs give "at once"
    about the "alone" time (compute-bound, a shared power limit aside); PEs that share SMs or take turns give W
    times it, and then an emulated-link overlap figure means little."""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    (m, n, k), op, fns = shard_gemms(rt, 7)

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def sync_all():
        torch.cuda.synchronize()
        flux_shmem.barrier()
        torch.cuda.synchronize()

    for name, fn in fns.items():
        alone = None
        for pe in range(W):
            sync_all()
            if rt.rank == pe:
                alone = timed(fn)
        sync_all()
        together = timed(fn)
        alones = rt.host.allgather(alone)
        togethers = rt.host.allgather(together)
        if rt.rank == 0:
            ratio = max(togethers) / max(alones)
            print(f"CHECK note: {name} {m}x{n}x{k}: alone {max(alones):.3f} ms, all {W} PEs at once "
                  f"{max(togethers):.3f} ms (x{ratio:.2f}; {W}x would mean turns or shared SMs), SM budget "
                  f"{op.budget.sms} ({op.budget.source})", flush=True)
        sync_all()
        # The benchmark's protocol on a shared GPU (benchmarks/baselines.py HostCollectives.sync: device sync and
        # an MPI barrier before every timed call) against a device barrier before every call (no host sync).
        def host_sync_barrier():
            torch.cuda.synchronize()
            rt.host.barrier()
        for proto, before in (("host sync + barrier", host_sync_barrier), ("device barrier", flux_shmem.barrier)):
            ms = per_call_ms(fn, before, 20)
            meds = rt.host.allgather(ms[len(ms) // 2])
            mins = rt.host.allgather(ms[0])
            if rt.rank == 0:
                print(f"CHECK note: {name}, per call after a {proto}: median {max(meds):.3f} ms, min {min(mins):.3f} "
                      "ms (max / min over PEs)", flush=True)
            sync_all()


