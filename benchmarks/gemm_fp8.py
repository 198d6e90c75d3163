#!/usr/bin/env python3
"""Our fp8 (e4m3) plain GEMM against torch._scaled_mm (cuBLASLt) on one GPU, no NVSHMEM (issue 26).

    python3 benchmarks/gemm_fp8.py [--shapes 8192x8192x8192,8192x1280x8192 | --suite tp-shard [--part 1/3]]
        [--scales tensor,rowwise] [--family gemm_rs|ag_gemm|both] [--rounds 5] [--budget-s S] [--jsonl out.jsonl]
    python3 benchmarks/gemm_fp8.py --summarize out.jsonl...   # the RESULTS.md lines from parts' records

For every shape and scale kind: A [M, K] and W [N, K] quantized to e4m3 (per-tensor or rowwise amax scales), bias
in bf16; both outputs checked against the dequantize-then-fp32 reference with the output poisoned (NaN) first,
then timed together by flux_shmem.kernels.tune.time_interleaved (CUDA graphs over rotated input sets). The
configuration is the chooser's (config.choose with dtype e4m3, no tuning cache). One line per case:

    fp8 <scales> MxNxK: ours X ms (config), scaled_mm Y ms, ratio Y/X (err ours E1, scaled_mm E2)

After the cases, one line per family and scale kind (the issue's RESULTS.md line; ratio = scaled_mm ms / ours ms):

    tp-shard fp8 <family> (<scales>): geomean G, min M at <MxNxK> over C shapes

FLUX_SHMEM_FP8_FAST_ACCUM=1 builds and times CUTLASS's FP8FastAccum kernels (torch._scaled_mm gets use_fast_accum
to match). Exit codes: 0 ok, 1 an output check failed, 2 bad arguments, 3 no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path for `benchmarks.shapes`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REL_TOL = 3e-2
E4M3_MAX = 448.0
SHAPES = "8192x8192x8192,8192x1280x8192,8192x8192x1024,16384x7168x8192,2048x3584x4096"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="comma-separated MxNxK")
    p.add_argument("--suite", help="a shape suite of benchmarks/shapes.py (tp-shard, tp-shard-quick) instead")
    p.add_argument("--part", default="1/1", help="I/N: every N-th shape of the suite from the I-th")
    p.add_argument("--scales", default="tensor,rowwise", help="comma-separated: tensor, rowwise")
    p.add_argument("--family", default="gemm_rs", choices=("ag_gemm", "gemm_rs", "both"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sets", type=int, default=2, help="rotated input sets (L2 not warm across calls)")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting cases after this many seconds")
    p.add_argument("--jsonl", help="append one JSON record per case")
    p.add_argument("--summarize", nargs="+", metavar="JSONL", help="print the summary lines of these records")
    args = p.parse_args(argv)
    if args.summarize:
        return args
    try:
        i, n = (int(x) for x in args.part.split("/"))
        assert 1 <= i <= n
    except (ValueError, AssertionError):
        p.error(f"--part: expected I/N with 1 <= I <= N, got {args.part!r}")
    if args.suite:
        from benchmarks import shapes as _shapes
        try:
            args.shape_list = [(s.m, s.n, s.k) for s in _shapes.suite(args.suite)]
        except ValueError as e:
            p.error(str(e))
    else:
        try:
            args.shape_list = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
            assert all(len(s) == 3 and min(s) > 0 for s in args.shape_list)
        except (ValueError, AssertionError):
            p.error(f"--shapes: expected MxNxK,... got {args.shapes!r}")
    args.shape_list = args.shape_list[i - 1::n]
    args.families = ("gemm_rs", "ag_gemm") if args.family == "both" else (args.family,)
    args.scale_list = [s for s in args.scales.split(",") if s]
    if not set(args.scale_list) <= {"tensor", "rowwise"}:
        p.error(f"--scales: tensor and/or rowwise, got {args.scales!r}")
    return args


def quantize(x, rowwise: bool):
    import torch
    amax = x.abs().amax(dim=1, keepdim=True) if rowwise else x.abs().amax()
    scale = (amax.float() / E4M3_MAX).clamp(min=1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


def make_sets(m, n, k, rowwise, nsets, seed=1234):
    """[(a8, w8, scale_a, scale_b, bias, out)] and the first set's dequantized fp32 reference."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets, ref = [], None
    for i in range(nsets):
        a8, sa = quantize(torch.randn(m, k, device="cuda", generator=g), rowwise)
        w8, sw = quantize(torch.randn(n, k, device="cuda", generator=g) * 0.05, rowwise)
        bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        if i == 0:
            ref = (a8.float() * sa) @ (w8.float() * sw).t() + bias.float()
        sb = sw.reshape(1, n) if rowwise else sw
        sets.append((a8, w8, sa, sb, bias, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)))
    return sets, ref


def geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary_lines(records: list[dict], label: str = "tp-shard") -> list[str]:
    """One line per (family, scales) over the records with both timings: geomean and min of scaled_mm / ours."""
    out = []
    for fam, kind in sorted({(r["family"], r["scales"]) for r in records}):
        rs = [(r["ms"]["scaled_mm"] / r["ms"]["ours"], f"{r['m']}x{r['n']}x{r['k']}") for r in records
              if r["family"] == fam and r["scales"] == kind and "scaled_mm" in r["ms"]]
        if rs:
            worst = min(rs)
            out.append(f"{label} fp8 {fam} ({kind}): geomean {geomean([x for x, _ in rs]):.3f}, min {worst[0]:.3f} "
                       f"at {worst[1]} over {len(rs)} shapes")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        records = [json.loads(line) for f in args.summarize for line in open(f) if line.startswith("{")]
        print("\n".join(summary_lines(records)))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gemm_fp8: needs an NVIDIA Hopper GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    from flux_shmem.kernels import build as kb
    from flux_shmem.kernels import config, tune
    from flux_shmem.kernels import gemm as kg
    fast = kb.fp8_fast_accum()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.cuda.current_device()
    failed = False
    records = []
    start = time.monotonic()
    cases = [(m, n, k, kind, fam) for m, n, k in args.shape_list for kind in args.scale_list for fam in args.families]
    for m, n, k, kind, family in cases:
        if args.budget_s and time.monotonic() - start > args.budget_s:
            print(f"gemm_fp8: budget of {args.budget_s:.0f} s spent; {len(cases) - len(records)} cases not run",
                  flush=True)
            break
        sets, ref = make_sets(m, n, k, kind == "rowwise", args.sets)
        choice = config.choose(m, n, k, "e4m3", "nk", sms, use_cache=False)
        g = kg.CutlassGemm.get(family, torch.float8_e4m3fn, "nk", choice.config)
        runs = []
        for a8, w8, sa, sb, bias, out in sets:
            sa_v, sb_v, sk = kg.fp8_scales(a8, w8.t(), sa, sb, bias=bias)
            runs.append(g.prepare(kg.plain_args(family, a8.data_ptr(), w8.data_ptr(), out.data_ptr(),
                                                bias.data_ptr(), m, n, k, sm_count=sms, device_id=dev,
                                                choice=choice, scale_a=sa_v.data_ptr(),
                                                scale_b=sb_v.data_ptr(), scale_kind=sk)))

        def ours(i, runs=runs):
            runs[i]()

        def theirs(i, sets=sets):
            a8, w8, sa, sb, bias, out = sets[i]
            out.copy_(torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, bias=bias,
                                       out_dtype=torch.bfloat16, use_fast_accum=fast))

        errs = {}
        for name, fn in (("ours", ours), ("scaled_mm", theirs)):
            sets[0][5].fill_(float("nan"))
            try:
                fn(0)
                torch.cuda.synchronize()
                errs[name] = tune.relative_error(sets[0][5], ref)
            except RuntimeError as e:  # a torch without this scale kind
                print(f"fp8 {kind} {m}x{n}x{k}: {name} failed: {e}", file=sys.stderr)
                errs[name] = None
        if errs["ours"] is None or errs["ours"] > REL_TOL:
            failed = True
            if errs["ours"] is None:
                continue
        fns = {"ours": ours} | ({"scaled_mm": theirs} if errs["scaled_mm"] is not None else {})
        times = tune.time_interleaved(fns, len(sets), rounds=args.rounds)
        ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        ratio = ms["scaled_mm"] / ms["ours"] if "scaled_mm" in ms else float("nan")
        e2 = f"{errs['scaled_mm']:.1e}" if errs["scaled_mm"] is not None else "n/a"
        print(f"fp8 {family} {kind} {m}x{n}x{k}: ours {ms['ours']:.3f} ms ({choice.config} swizzle={choice.swizzle} "
              f"split={choice.split}), scaled_mm {ms.get('scaled_mm', float('nan')):.3f} ms, ratio {ratio:.2f} "
              f"(err ours {errs['ours']:.1e}, scaled_mm {e2})", flush=True)
        rec = {"m": m, "n": n, "k": k, "scales": kind, "family": family, "choice": choice.describe(),
               "fast_accum": fast, "ms": ms, "errors": errs, "device": torch.cuda.get_device_name()}
        records.append(rec)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(rec) + "\n")
    print("\n".join(summary_lines(records, args.suite or "shapes")), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
