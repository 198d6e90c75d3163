#!/usr/bin/env python3
"""Our fp8 (e4m3) plain GEMM against torch._scaled_mm (cuBLASLt) on one GPU, no NVSHMEM (issue 26).

    python3 benchmarks/gemm_fp8.py [--shapes 8192x8192x8192,8192x1280x8192] [--scales tensor,rowwise]
        [--family gemm_rs] [--rounds 5] [--jsonl out.jsonl]

For every shape and scale kind: A [M, K] and W [N, K] quantized to e4m3 (per-tensor or rowwise amax scales), bias
in bf16; both outputs checked against the dequantize-then-fp32 reference with the output poisoned (NaN) first,
then timed together by flux_shmem.kernels.tune.time_interleaved (CUDA graphs over rotated input sets). The
configuration is the chooser's (config.choose with dtype e4m3, no tuning cache). One line per case:

    fp8 <scales> MxNxK: ours X ms (config), scaled_mm Y ms, ratio Y/X (err ours E1, scaled_mm E2)

FLUX_SHMEM_FP8_FAST_ACCUM=1 builds and times CUTLASS's FP8FastAccum kernels (torch._scaled_mm gets use_fast_accum
to match). Exit codes: 0 ok, 1 an output check failed, 2 bad arguments, 3 no GPU.
"""
from __future__ import annotations

import argparse
import json
import sys

REL_TOL = 3e-2
E4M3_MAX = 448.0
SHAPES = "8192x8192x8192,8192x1280x8192,8192x8192x1024,16384x7168x8192,2048x3584x4096"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="comma-separated MxNxK")
    p.add_argument("--scales", default="tensor,rowwise", help="comma-separated: tensor, rowwise")
    p.add_argument("--family", default="gemm_rs", choices=("ag_gemm", "gemm_rs"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sets", type=int, default=2, help="rotated input sets (L2 not warm across calls)")
    p.add_argument("--jsonl", help="append one JSON record per case")
    args = p.parse_args(argv)
    try:
        args.shape_list = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
        assert all(len(s) == 3 and min(s) > 0 for s in args.shape_list)
    except (ValueError, AssertionError):
        p.error(f"--shapes: expected MxNxK,... got {args.shapes!r}")
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


def main(argv=None) -> int:
    args = parse_args(argv)
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
    for m, n, k in args.shape_list:
        for kind in args.scale_list:
            sets, ref = make_sets(m, n, k, kind == "rowwise", args.sets)
            choice = config.choose(m, n, k, "e4m3", "nk", sms, use_cache=False)
            g = kg.CutlassGemm.get(args.family, torch.float8_e4m3fn, "nk", choice.config)
            runs = []
            for a8, w8, sa, sb, bias, out in sets:
                sa_v, sb_v, sk = kg.fp8_scales(a8, w8.t(), sa, sb, bias=bias)
                runs.append(g.prepare(kg.plain_args(args.family, a8.data_ptr(), w8.data_ptr(), out.data_ptr(),
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
            fns = {"ours": ours} | ({"scaled_mm": theirs} if errs["scaled_mm"] is not None else {})
            times = tune.time_interleaved(fns, len(sets), rounds=args.rounds)
            ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            ratio = ms["scaled_mm"] / ms["ours"] if "scaled_mm" in ms else float("nan")
            e2 = f"{errs['scaled_mm']:.1e}" if errs["scaled_mm"] is not None else "n/a"
            print(f"fp8 {kind} {m}x{n}x{k}: ours {ms['ours']:.3f} ms ({choice.config} swizzle={choice.swizzle} "
                  f"split={choice.split}), scaled_mm {ms.get('scaled_mm', float('nan')):.3f} ms, ratio {ratio:.2f} "
                  f"(err ours {errs['ours']:.1e}, scaled_mm {e2})", flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps({"m": m, "n": n, "k": k, "scales": kind, "family": args.family,
                                        "choice": choice.describe(), "fast_accum": fast, "ms": ms, "errors": errs,
                                        "device": torch.cuda.get_device_name()}) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
