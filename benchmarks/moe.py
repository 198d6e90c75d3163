#!/usr/bin/env python3
"""Tensor-parallel MoE layers (issue 38): our AllGatherGroupGEMM / GroupGEMMReduceScatter against torch's grouped
GEMM with NCCL collectives and against a per-expert torch.matmul loop, per op and for the whole expert block.

    flux-launch -n 2 benchmarks/moe.py                     # = benchmarks/run.py --ops moe
    flux-launch -n 4 benchmarks/moe.py --models mixtral-8x7b --routing skewed --tokens 4096

Per-GPU shapes of each model's expert layer at TP = world (every PE holds 1/world of each expert's intermediate
size): mixtral-8x7b (hidden 4096, inter 14336, 8 experts, top-2), qwen3-30b-a3b (2048, 768, 128, top-8),
deepseek-v3 (7168, 2048, 256 routed experts, top-8; its shared expert is a dense layer, not timed here).
--tokens is the batch of every PE together (M). Routing: balanced (uniform logits) or skewed (half the experts
four times as likely).

Implementations (each checked first against an fp64 reference of the block on a sample of tokens):
  flux       our ops, decomposed: our AllGather / ReduceScatter, torch._grouped_mm, the fp32 combine
  pipelined  our ops in mode 'pipelined' (the same kernels overlapped block by block; W > 1)
  torch      torch._grouped_mm with NCCL all_gather_into_tensor / reduce_scatter_tensor (needs one GPU per rank)
  loop       a per-expert torch.matmul loop with the same NCCL collectives
Where ranks share a GPU (MPS) NCCL cannot run: only flux is timed, the reason printed. Lines:
  moe <op> <model> <routing> W=<w> M=<m>: flux X ms (host H), pipelined P ms (host H), torch Y ms (host H), ...
(device medians; host H: the host's time per call with the device kept busy, `host_ms`)
Links are emulated as for every op (FLUX_SHMEM_LINK_GBPS, runtime/pacing.py) when the environment asks.
--predict W needs no GPU: the planner's model of the fused AllGatherGroupGEMM (not built yet) against the
decomposed one, per model and routing (predictions, not measurements).
Exit codes: 0 ok, 1 a check failed, 2 bad arguments, 3 no GPU.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

PROG = "benchmarks/moe.py"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
TOL = 1e-2


@dataclasses.dataclass(frozen=True)
class MoEModel:
    name: str
    hidden: int
    inter: int
    experts: int
    topk: int


MODELS = {m.name: m for m in (MoEModel("mixtral-8x7b", 4096, 14336, 8, 2),
                              MoEModel("qwen3-30b-a3b", 2048, 768, 128, 8),
                              MoEModel("deepseek-v3", 7168, 2048, 256, 8))}
ROUTINGS = ("balanced", "skewed")


def _list_of(choices, what):
    def parse(text: str) -> list:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {','.join(bad) or text!r}: choose from "
                                             f"{','.join(choices)}")
        return items
    return parse


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--models", type=_list_of(tuple(MODELS), "model"), default=list(MODELS))
    p.add_argument("--routing", type=_list_of(ROUTINGS, "routing"), default=list(ROUTINGS))
    p.add_argument("--tokens", type=_positive, default=8192, help="M: every PE's tokens together (default 8192)")
    p.add_argument("--iters", type=_positive, default=20)
    p.add_argument("--warmup", type=_positive, default=5)
    p.add_argument("--jsonl", help="one JSON object per result")
    p.add_argument("--predict", type=_positive, metavar="W",
                   help="no GPU: print the planner's model of the fused AllGatherGroupGEMM (plan.moe.fused_estimate) "
                        "against the decomposed one at W PEs of one node, the best of comm blocks 2-16 and chunks "
                        "of 64 / 128 rows, NVLink (W = 8) or links emulated as on one GPU (W < 8)")
    return p


def shard_shapes(model: MoEModel, world: int, tokens: int) -> tuple[int, int]:
    """(tokens per PE, intermediate size per PE); ValueError naming what does not divide."""
    if model.inter % world:
        raise ValueError(f"{model.name}: inter={model.inter} does not split over {world} PEs")
    if tokens % world:
        raise ValueError(f"--tokens {tokens} is not a multiple of the world size {world}")
    if (model.inter // world) % 8:
        raise ValueError(f"{model.name}: inter / world = {model.inter // world} is not a multiple of 8")
    return tokens // world, model.inter // world


def model_shards(names, world: int, tokens: int, say, what: str = "moe"):
    """(name, model, tokens per PE, inter per PE) of each model that splits over `world` PEs; `say` the others."""
    for name in names:
        try:
            m, inter = shard_shapes(MODELS[name], world, tokens)
        except ValueError as e:
            say(f"{what} {name}: skipped: {e}")
            continue
        yield name, MODELS[name], m, inter


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else EXIT_OK
    if args.predict:
        return predict(args)
    import torch
    if not torch.cuda.is_available():
        if int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))) == 0:
            print(f"{PROG}: cannot run: no CUDA device visible (torch.cuda.is_available() is False); this "
                  "benchmark needs NVIDIA Hopper GPUs (launch with `flux-launch -n N benchmarks/moe.py`)",
                  file=sys.stderr, flush=True)
        return EXIT_NO_GPU
    return _run(args)


def predict(args) -> int:
    """The model's fused vs decomposed AllGatherGroupGEMM per model and routing (a prediction, not a measurement)."""
    import torch

    from flux_shmem.plan import costs, inputs
    from flux_shmem.plan import moe as pmoe
    W = args.predict
    links = costs.Links() if W >= 8 else costs.emulated_links(360.0 * 132 / W / 132, 1.5)
    for name, mdl, _, inter in model_shards(args.models, W, args.tokens, print, "moe predict"):
        n = 2 * inter  # (the gate and up projections of SwiGLU experts in one grouped GEMM)
        for routing in args.routing:
            g = torch.Generator().manual_seed(5)
            logits = torch.randn(args.tokens, mdl.experts, generator=g)
            if routing == "skewed":
                logits[:, : mdl.experts // 2] += 1.386
            ids = torch.topk(logits, mdl.topk, dim=1).indices.numpy()
            gemm = inputs.gemm_model(mdl.hidden, n=n)
            sms = 132 if W >= 8 else 132 // W
            best = None
            for blocks in (2, 4, 8, 16):
                for chunk in (64, 128):
                    if blocks >= sms:
                        continue
                    est = pmoe.fused_estimate(ids, mdl.experts, world=W, node_size=W, pe=0, hidden=mdl.hidden, n=n,
                                              elem_bytes=2, gemm=gemm, sms=sms, comm_blocks=blocks, chunk_rows=chunk,
                                              links=links, decomposed_comm_blocks=min(16, sms - 2))
                    if best is None or est.fused_us < best[0].fused_us:
                        best = (est, blocks, chunk)
            est, blocks, chunk = best
            print(f"moe predict ag {name} {routing} W={W} M={args.tokens}: fused {est.fused_us / 1e3:.3f} ms "
                  f"(comm blocks {blocks}, chunks of {chunk} rows), decomposed {est.decomposed_us / 1e3:.3f} ms "
                  f"(comm {est.comm_us / 1e3:.3f} + grouped GEMM {est.gemm_us / 1e3:.3f}): "
                  f"{est.decomposed_us / est.fused_us:.2f}x, {100 * est.hidden:.0f}% hidden (model)")
    return EXIT_OK


# ----------------------------------------------------------------------------- GPU path
def _run(args) -> int:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import flux_shmem
    from benchmarks import baselines
    from benchmarks.timing import cuda_time
    from flux_shmem.ops import moe as moe_ops
    from flux_shmem.plan import moe as pmoe

    comm = MPI.COMM_WORLD
    rt = flux_shmem.init()
    W, me = rt.world_size, rt.rank
    dev = torch.device("cuda", rt.device)
    nccl = None
    if baselines.gpus_shared(comm):
        nccl = "several ranks share one GPU (NCCL needs one GPU per rank): torch and loop not timed"
    else:
        baselines.init_torch_distributed(comm, me, W, rt.device)

    def say(*a):
        if me == 0:
            print(*a, flush=True)

    if nccl:
        say(f"# {nccl}")
    failed = 0
    out_f = open(args.jsonl, "w") if args.jsonl and me == 0 else None
    for name, mdl, m, inter in model_shards(args.models, W, args.tokens, say):
        H, E, K = mdl.hidden, mdl.experts, mdl.topk
        g = torch.Generator(device=dev).manual_seed(1234)
        w1 = (torch.randn(E, inter, H, generator=g, device=dev) * H ** -0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, H, inter, generator=g, device=dev) * inter ** -0.5).to(torch.bfloat16)
        ag = flux_shmem.AllGatherGroupGEMM(W * m, H, inter, E, K, mode="decomposed")
        rs = flux_shmem.GroupGEMMReduceScatter(W * m, H, inter, E, K, mode="decomposed")
        pag = flux_shmem.AllGatherGroupGEMM(W * m, H, inter, E, K, mode="pipelined") if W > 1 else None
        prs = flux_shmem.GroupGEMMReduceScatter(W * m, H, inter, E, K, mode="pipelined") if W > 1 else None
        for routing in args.routing:
            gen = torch.Generator(device=dev).manual_seed(99 + me)
            x = torch.randn(m, H, generator=gen, device=dev).to(torch.bfloat16)
            logits = torch.randn(m, E, generator=gen, device=dev)
            if routing == "skewed":
                logits[:, : E // 2] += 1.386  # (x4 as likely)
            top = torch.topk(logits, K, dim=1)
            ids, wts = top.indices, torch.softmax(top.values, dim=1)

            def flux_ag():
                return ag(x, ids, w1, topk_weights=wts, check_ids=False)

            y, r = flux_ag()
            h = torch.nn.functional.silu(y.float()).to(torch.bfloat16)

            def flux_rs():
                return rs(h, w2, r)

            def flux_block(a=ag, b=rs):
                yy, rr = a(x, ids, w1, topk_weights=wts, check_ids=False)
                return b(torch.nn.functional.silu(yy.float()).to(torch.bfloat16), w2, rr)

            impls = {"ag": {"flux": flux_ag}, "rs": {"flux": flux_rs}, "block": {"flux": flux_block}}
            checks = [flux_block]
            if pag is not None:
                py, pr = pag(x, ids, w1, topk_weights=wts, check_ids=False)  # (rows in its blocked layout)
                ph = torch.nn.functional.silu(py.float()).to(torch.bfloat16)
                impls["ag"]["pipelined"] = lambda: pag(x, ids, w1, topk_weights=wts, check_ids=False)
                impls["rs"]["pipelined"] = lambda: prs(ph, w2, pr)
                impls["block"]["pipelined"] = lambda: flux_block(pag, prs)
                checks.append(lambda: flux_block(pag, prs))
            if nccl is None:
                xg = torch.empty(W * m, H, dtype=torch.bfloat16, device=dev)
                rg = torch.empty(W * m, 2 * K, dtype=torch.int32, device=dev)
                out_nccl = torch.empty(m, H, dtype=torch.bfloat16, device=dev)

                def torch_ag(loop=False):
                    dist.all_gather_into_tensor(xg, x)
                    packed = torch.cat([ids.to(torch.int32), wts.view(torch.int32)], dim=1)
                    dist.all_gather_into_tensor(rg, packed)
                    rr = pmoe.route(rg[:, :K], E, rg[:, K:].contiguous().view(torch.float32))
                    xs = xg.index_select(0, rr.rows)
                    if not loop:
                        return moe_ops.grouped_mm(xs, w1, rr.offs, "nk"), rr
                    return _loop(xs, w1, rr), rr

                def torch_rs(hh, rr, loop=False):
                    part = _loop(hh, w2, rr) if loop else moe_ops.grouped_mm(hh, w2, rr.offs, "nk")
                    dist.reduce_scatter_tensor(out_nccl, moe_ops.combine(part, rr, rr.weights))
                    return out_nccl

                impls["ag"].update(torch=lambda: torch_ag(), loop=lambda: torch_ag(True))
                impls["rs"].update(torch=lambda: torch_rs(h, r), loop=lambda: torch_rs(h, r, True))
                def torch_block(loop=False):
                    yy, rr = torch_ag(loop)
                    return torch_rs(torch.nn.functional.silu(yy.float()).to(torch.bfloat16), rr, loop)

                impls["block"].update(torch=lambda: torch_block(), loop=lambda: torch_block(True))
            # correctness: the block (each of our paths) against fp64 on this PE's first 64 tokens
            err = max(_check_block(comm, f(), x, ids, wts, w1, w2, me, H) for f in checks)
            ok = err < TOL
            failed += not ok
            sync = (lambda: dist.barrier()) if nccl is None else (lambda: comm.Barrier())
            times, host = {}, {}
            for op, fns in impls.items():
                for impl, fn in fns.items():
                    ms = cuda_time(lambda f=fn: f(), [()], warmup=args.warmup, iters=args.iters,
                                   sync=sync, lead_us=0.0 if nccl is None else 200.0)
                    med = statistics.median(ms)
                    times[(op, impl)] = max(comm.allgather(med))  # the slowest PE's median
                    host[(op, impl)] = max(comm.allgather(host_ms(fn, sync)))
            for op in impls:
                parts = [f"{impl} {times[(op, impl)]:.3f} ms (host {host[(op, impl)]:.3f})" for impl in impls[op]]
                say(f"moe {op} {name} {routing} W={W} M={W * m}: " + ", ".join(parts) +
                    ("" if ok else f"  CHECK FAILED (rel err {err:.2e})"))
                if out_f:
                    out_f.write(json.dumps(dict(op=op, model=name, routing=routing, world=W, tokens=W * m,
                                                ms={impl: times[(op, impl)] for impl in impls[op]},
                                                host_ms={impl: host[(op, impl)] for impl in impls[op]},
                                                rel_err=err, ok=ok)) + "\n")
    if out_f:
        out_f.close()
    flux_shmem.finalize()
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def host_ms(fn, sync, calls: int = 10) -> float:
    """The host's time per call of `fn` (ms) with the device kept busy (a long GPU sleep queued first), so the host
    never waits for it: beside the device time it tells a host-bound path (host >= device) from a device-bound one,
    and a call that synchronises shows the sleep."""
    import time

    import torch
    from benchmarks.timing import gpu_sleep
    sync()
    torch.cuda.synchronize()
    gpu_sleep(100_000.0)  # 100 ms: longer than `calls` calls of any shape here take to launch
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def _loop(a, w, rr):
    """Per-expert torch.matmul over the grouped rows (the baseline without a grouped kernel)."""
    import torch
    out = a.new_empty(a.shape[0], w.shape[1])
    lo = 0
    for e, hi in enumerate(rr.offs.tolist()):
        if hi > lo:
            torch.matmul(a[lo:hi], w[e].t(), out=out[lo:hi])
        lo = hi
    return out


def _check_block(comm, out, x, ids, wts, w1, w2, me, H) -> float:
    """Relative error of this PE's first 64 output rows against fp64. silu acts per intermediate column, so the
    block is the sum over PEs of each PE's shards' part: every PE computes its part for every PE's first 64 tokens
    (gathered by MPI; the weights stay where they are: a DeepSeek-V3 layer's would not fit one host), and the parts
    are summed."""
    import torch
    n = min(64, x.shape[0])
    everyone = comm.allgather((x[:n].cpu(), ids[:n].cpu(), wts[:n].cpu()))
    parts = []
    for xs, ids_p, wts_p in everyone:
        part = torch.zeros(n, H, dtype=torch.float64, device=x.device)
        xd = xs.to(x.device).double()
        for e in ids_p.unique().tolist():
            t, j = torch.nonzero(ids_p == e, as_tuple=True)
            h = torch.nn.functional.silu(xd[t.to(x.device)] @ w1[e].double().t()) @ w2[e].double().t()
            part.index_add_(0, t.to(x.device), h * wts_p[t, j].double().to(x.device)[:, None])
        parts.append(part.cpu())
    ref = sum(theirs[me] for theirs in comm.allgather(parts))
    got = out[:n].double().cpu()
    return float((got - ref).norm() / ref.norm())


if __name__ == "__main__":
    sys.exit(main())
