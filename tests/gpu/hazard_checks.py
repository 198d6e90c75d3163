"""GPU checks, groups soak and hazards: back-to-back calls, slow peers, large nodes, SM budgets, the start
event."""
from __future__ import annotations

import os

import torch

import flux_shmem
from common import Skip, check, gathered_inputs, rel_err, weight


def soak(rt, op, make_inputs, reference, calls: int, every: int, what: str):
    """`calls` back-to-back calls over changing inputs (4 rotating sets), no host sync between them; every
    `every` calls one output is kept and compared with its reference afterwards (outputs are fresh tensors, so a
    call that wrote nothing would show as garbage)."""
    sets = [make_inputs(s) for s in range(4)]
    refs = [reference(*x) for x in sets]
    kept = []
    for i in range(calls):
        out = op(*sets[i % 4][0])
        if i % every == every - 1:
            kept.append((i, out))
    torch.cuda.synchronize()
    flux_shmem.check_errors()
    for i, out in kept:
        e = rel_err(out, refs[i % 4])
        assert e < 2e-2, f"soak {what}: call {i}: rel err {e}"


@check("soak")
def soak_fused_ops(rt):
    """2,000 back-to-back fused calls per op (and per all-gather engine), inputs changing every call, checked
    every 100 calls: with PEs running at once (MPS), races between a call and the next one's writes show here."""
    W = rt.world_size
    calls = int(os.environ.get("FLUX_SHMEM_SOAK_CALLS", "2000"))
    ms, n, k = 256, 512, 512

    def ag_inputs(seed):
        a_all = gathered_inputs(rt, (ms, k), torch.bfloat16, 300 + seed)
        return (a_all[rt.rank], weight(k, n, "nk", torch.bfloat16, 400 + seed)), torch.cat(a_all)

    engines = ["sm"] + (["ce"] if rt.node_size == W and flux_shmem.runtime.pacing.emulation() is None else [])
    only = os.environ.get("FLUX_SHMEM_SOAK_ENGINES")  # e.g. "ce": soak only these AllGatherGEMM engines
    if only:
        engines = [e for e in engines if e in only.split(",")]
    for eng in engines:
        if rt.rank == 0:
            print(f"CHECK note: soak of AllGatherGEMM engine={eng}", flush=True)
        op = flux_shmem.AllGatherGEMM(ms * W, n, k, torch.bfloat16, mode="fused", engine=eng)
        soak(rt, lambda a, b: op(a, b), ag_inputs, lambda x, a_full: a_full.double() @ x[1].double(), calls, 100,
             f"AllGatherGEMM engine={eng}")
        flux_shmem.barrier()

    def rs_inputs(seed):
        a_all = gathered_inputs(rt, (ms * W, k), torch.bfloat16, 500 + seed)
        bs = [weight(k, n, "kn", torch.bfloat16, 600 + 10 * seed + pe) for pe in range(W)]
        return (a_all[rt.rank], bs[rt.rank]), (a_all, bs)

    def rs_ref(x, full):
        a_all, bs = full
        tot = sum(a.double() @ b.double() for a, b in zip(a_all, bs))
        return tot[rt.rank * ms:(rt.rank + 1) * ms]

    op = flux_shmem.GEMMReduceScatter(ms * W, n, k, torch.bfloat16, mode="fused")
    soak(rt, lambda a, b: op(a, b), rs_inputs, rs_ref, calls, 100, "GEMMReduceScatter")
    flux_shmem.barrier()
    rs = flux_shmem.ReduceScatter(ms * W, n, torch.bfloat16)
    soak(rt, lambda x: rs(x), lambda s: ((gathered_inputs(rt, (ms * W, n), torch.bfloat16, 700 + s)[rt.rank],),
                                         gathered_inputs(rt, (ms * W, n), torch.bfloat16, 700 + s)),
         lambda x, xs: torch.stack([v.double() for v in xs]).sum(0)[rt.rank * ms:(rt.rank + 1) * ms], calls, 100,
         "ReduceScatter")


@check("hazards")
def input_buffer_waits_for_slow_peers(rt):
    """Hazard: overwriting the symmetric input while a peer still sums the previous call's. PE 1 reads slowly (its
    link paced to 2 GB/s); PE 0 writes its next input right after each call. Through input_buffer() (which waits
    for every node peer's 'done reading' signal) every result is right; writing the buffer directly, without that
    wait, PE 1's results go wrong (shown when the PEs really run at once)."""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    rows, cols = 64 * W, 2048
    slow = rt.rank == 1
    if slow:
        os.environ["FLUX_SHMEM_LINK_GBPS"] = "2"
    rs = flux_shmem.ReduceScatter(rows, cols, torch.bfloat16, unit_rows=8, comm_blocks=2)
    os.environ.pop("FLUX_SHMEM_LINK_GBPS", None)
    seeds = range(900, 906)
    inputs = {s: gathered_inputs(rt, (rows, cols), torch.bfloat16, s) for s in seeds}

    def run(safe: bool) -> list[float]:
        outs = []
        for s in seeds:
            buf = rs.input_buffer(rows) if safe else rs.engine.partial[:rows]
            buf.copy_(inputs[s][rt.rank])
            outs.append((s, rs(buf)))
        torch.cuda.synchronize()
        errs = [rel_err(o, torch.stack([v.double() for v in inputs[s]]).sum(0)[rt.rank * 64:(rt.rank + 1) * 64])
                for s, o in outs]
        flux_shmem.barrier()
        torch.cuda.synchronize()
        return errs
    unsafe = run(False)
    safe = run(True)
    assert max(safe) < 1e-2, f"PE {rt.rank}: input_buffer results wrong: {safe}"
    worst = rt.host.allgather(max(unsafe))
    if rt.rank == 0:
        print(f"CHECK note: without the wait, the worst result error over PEs was {max(worst):.3g} "
              f"({'the race showed' if max(worst) > 1e-2 else 'the race did not show this time'})", flush=True)


@check("hazards")
def large_node_reduce(rt):
    """Hazard: fixed-size source arrays (8 node peers, 64 nodes) in the reduce kernel. The kernel now keeps the
    node peers' pointers in shared memory sized at launch: a node of any size (run with 12 or 16 PEs)."""
    W = rt.world_size
    rows, cols = 16 * W, 256
    rs = flux_shmem.ReduceScatter(rows, cols, torch.bfloat16)
    xs = gathered_inputs(rt, (rows, cols), torch.bfloat16, 1234)
    out = rs(xs[rt.rank])
    ref = torch.stack([x.double() for x in xs]).sum(0)[rt.rank * 16:(rt.rank + 1) * 16]
    assert rel_err(out, ref) < 1e-2, f"reduce-scatter over a node of {rt.node_size}: rel err {rel_err(out, ref)}"
    op = flux_shmem.GEMMReduceScatter(128 * W, 256, 128, torch.bfloat16, mode="fused")
    a_all = gathered_inputs(rt, (128 * W, 128), torch.bfloat16, 55)
    bs = [weight(128, 256, "kn", torch.bfloat16, 56 + pe) for pe in range(W)]
    out = op(a_all[rt.rank], bs[rt.rank])
    full = sum(a.double() @ b.double() for a, b in zip(a_all, bs))
    e = rel_err(out, full[rt.rank * 128:(rt.rank + 1) * 128])
    assert e < 2e-2, f"GEMMReduceScatter over a node of {rt.node_size}: rel err {e}"


@check("hazards")
def sm_budget_and_occupancy(rt):
    """The persistent grids fit this context's SM budget (MPS share): say what the runtime and the driver see."""
    from flux_shmem.runtime.sm_budget import _affinity_sms
    op = flux_shmem.AllGatherGEMM(1024 * rt.world_size, 1024, 1024, torch.bfloat16, mode="fused")
    plan = op.call_plan(1024 * rt.world_size)
    g = op.kernel("kn", op.gemm_choice(1024 * rt.world_size, "kn", op.sms).config)
    a = torch.randn((1024 * rt.world_size, 1024), device="cuda").to(torch.bfloat16)
    op.gemm_only(a, weight(1024, 1024, "kn", torch.bfloat16, 1))
    torch.cuda.synchronize()
    cap = sorted(set(g._max_ctas.values()))  # per stream this process launched it on
    info = (f"PE {rt.rank}: budget {op.budget} affinity={_affinity_sms()} MPS%="
            f"{os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')} max resident GEMM CTAs={cap} "
            f"plan={plan.describe()}")
    print("CHECK info: " + info, flush=True)
    assert plan.gemm_sms + plan.comm_blocks <= op.budget.sms, info
    assert op.sms <= op.budget.sms


@check("hazards")
def start_event_releases_at_block_start(rt):
    """When does CUDA's launch-completion event (kernels.module.StartEvent, which the fused ops wait on before
    their second kernel) fire: once the kernel's blocks run, or only at its end? A one-thread kernel on stream A
    waits (2 s timeout, private error record) for a flag that stream B writes after waiting on the event of A's
    launch. Block start: A returns at once; end: A times out first. Informational: "at block start" cannot be told
    apart from an event that holds nothing back, which is why AllGatherGEMM gates its GEMM on the gather kernel's
    own start flag instead (AllGather.wait_started)."""
    import ctypes
    import time
    from flux_shmem.kernels import abi
    from flux_shmem.kernels.module import StartEvent, load, write_value_async
    if rt.world_size > 1 and rt.rank != 0:
        return
    words = ctypes.sizeof(abi.ErrorRecord) // 8
    record = torch.zeros(words, dtype=torch.int64, pin_memory=True)
    slot = torch.zeros(2, dtype=torch.int64, device="cuda")
    slot[1] = record.data_ptr()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    ctx = abi.Ctx(err=slot.data_ptr(), timeout_ns=int(2e9), my_pe=rt.rank, n_pes=rt.world_size, trap_on_timeout=0)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    ev = StartEvent()
    t0 = time.perf_counter()
    load("collectives").kernel("fs_wait_signal").launch(abi.WaitArgs(ctx=ctx, sig=flag.data_ptr(), expected=1, site=9), 1, 32,
                                                        stream=a, started=ev)
    ev.wait(b)
    write_value_async(flag.data_ptr(), 1, b)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    timed_out = abi.ErrorRecord.from_address(record.data_ptr()).flag == 1
    when = "only at the kernel's end (the waiting kernel timed out first)" if timed_out else "at block start"
    print(f"CHECK note: the launch-completion event fired {when}: {dt * 1e3:.1f} ms, MPS "
          f"{os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE') or 'off'}", flush=True)


