#!/usr/bin/env python3
"""Sweep the GEMM kernel configurations (flux_shmem/kernels/registry.py) x swizzles x K splits against cuBLAS on
one GPU (no communication, no NVSHMEM): the exploration tool behind the chooser's model. (For the issue-11 figures,
heuristic and tuned choices over a shape suite, use benchmarks/gemm_shapes.py; to record choices, flux_shmem.tune.)

Build the configurations here first (no GPU needed), carry the cache, then on the GPU machine:

    python3 -m flux_shmem.build --family gemm_rs --config all
    python3 benchmarks/gemm_tune.py --configs all --swizzles 1,8 --splits 1,auto --layouts kn,nk \\
        --shapes tp-shard-quick

For every shape and layout, cuBLAS (torch.matmul) and every candidate are checked (poisoned output, compared with
cuBLAS's) and then timed together with flux_shmem.kernels.tune.time_interleaved (CUDA graphs over rotated input
sets, rounds in alternating order, medians). `--splits auto` adds the model's best split of each configuration.
The last lines are a table: per shape and layout, cuBLAS TFLOP/s, each configuration's best ratio cuBLAS / ours (with
its swizzle and split) and the heuristic's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repo root (as run.py does)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks import shapes as _shapes  # noqa: E402

DEFAULT_SHAPES = ("8192x8192x8192,16384x4096x8192,8192x28672x8192,16384x28672x8192,16384x8192x28672,"
                  "8192x53248x8192,16384x12288x49152,8192x16384x53248")


def shape_list(text: str) -> list[tuple[int, int, int]]:
    parsed = _shapes.parse_shapes(text)
    if isinstance(parsed, _shapes.SuiteName):
        return [(s.m, s.n, s.k) for s in _shapes.suite(parsed)]
    return parsed


def candidates(m, n, k, sm_count, configs, swizzles, splits):
    from flux_shmem.kernels import config as kconfig
    from flux_shmem.kernels import registry
    out = []
    for name in configs:
        cfg = registry.get(name)
        sp = set()
        for s in splits:
            if s == "auto":
                best = min((e for e in kconfig.candidates(m, n, k, sm_count, configs=[name])), key=lambda e: e.us)
                sp.add(best.split)
            elif int(s) <= cfg.max_splits:
                sp.add(int(s))
        for split in sorted(sp):
            for sw in swizzles:
                out.append(kconfig.Choice(name, sw, split, "candidate", "sweep"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="all", help="comma list of registry names, or 'all'")
    p.add_argument("--family", default="gemm_rs", choices=("ag_gemm", "gemm_rs"))
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of MxNxK, or tp-shard / tp-shard-quick")
    p.add_argument("--layouts", default="kn", help="kn (B [K,N]) and/or nk (B [N,K])")
    p.add_argument("--swizzles", default="1,8")
    p.add_argument("--splits", default="1,auto", help="comma list of K splits and/or 'auto' (the model's best)")
    p.add_argument("--sm-count", type=int, default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--jsonl", default=None)
    args = p.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("gemm_tune.py: no CUDA device visible", file=sys.stderr)
        return 3
    from flux_shmem.kernels import config as kconfig
    from flux_shmem.kernels import registry, tune

    configs = list(registry.names()) if args.configs == "all" else [c for c in args.configs.split(",") if c]
    for c in configs:
        registry.get(c)
    swizzles = [int(s) for s in args.swizzles.split(",")]
    splits = [s for s in args.splits.split(",") if s]
    sms = args.sm_count or torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    dtype = torch.bfloat16
    rows, rc = [], 0
    jsonl = open(args.jsonl, "w") if args.jsonl else None
    for layout in args.layouts.split(","):
        for m, n, k in shape_list(args.shapes):
            sets = tune.make_inputs(m, n, k, dtype, layout, tune.rotation_count(m, n, k))
            cublas = tune.cublas_fn(sets)
            cublas(0)
            torch.cuda.synchronize()
            ref = sets[0][2].clone()
            heur = kconfig.choose(m, n, k, "bf16", layout, sms, use_cache=False)
            cands = candidates(m, n, k, sms, configs, swizzles, splits)
            if all(tune.label(c) != tune.label(heur) for c in cands):
                cands.append(heur)
            fns, errs, by = {"cublas": cublas}, {}, {}
            for c in cands:
                name = tune.label(c)
                fns[name] = tune.ours_fn(args.family, c, sets, sms, dtype, layout)
                errs[name], by[name] = tune.check_against(fns[name], sets, ref), c
            times = tune.time_interleaved(fns, len(sets), rounds=args.rounds)
            med = {name: statistics.median(t) for name, t in times.items()}
            flop = 2.0 * m * n * k
            for name, c in by.items():
                rec = {"layout": layout, "shape": f"{m}x{n}x{k}", "config": c.config, "swizzle": c.swizzle,
                       "split": c.split, "heuristic": name == tune.label(heur), "ours_ms": med[name],
                       "cublas_ms": med["cublas"], "ratio": med["cublas"] / med[name],
                       "cublas_tflops": flop / med["cublas"] / 1e9, "rel_err_vs_cublas": errs[name],
                       "ok": errs[name] < tune.REL_TOL}
                rc |= not rec["ok"]
                rows.append(rec)
                if jsonl:
                    jsonl.write(json.dumps(rec) + "\n")
            print(f"{layout} {m}x{n}x{k}: " + ", ".join(f"{nm} {med['cublas'] / med[nm]:.3f}" for nm in by),
                  flush=True)
            del sets, ref, fns
    if jsonl:
        jsonl.close()
    print(f"{'layout':6} {'shape':18} {'cuBLAS':>7} " + " ".join(f"{c:>26}" for c in configs) + f" {'heuristic':>26}")
    for lay, shape in sorted({(r["layout"], r["shape"]) for r in rows},
                             key=lambda t: (t[0], [int(x) for x in t[1].split("x")])):
        rs = [r for r in rows if r["layout"] == lay and r["shape"] == shape]
        cells = []
        for c in configs + ["heuristic"]:
            sel = [r for r in rs if (r["heuristic"] if c == "heuristic" else r["config"] == c)]
            if not sel:
                cells.append(f"{'-':>26}")
                continue
            b = max(sel, key=lambda r: r["ratio"])
            flag = "" if all(r["ok"] for r in sel) else "!"
            tag = f"{b['config']}/" if c == "heuristic" else ""
            cells.append(f"{b['ratio']:.3f} {tag}sw{b['swizzle']}/sp{b['split']}{flag}".rjust(26))
        print(f"{lay:6} {shape:18} {rs[0]['cublas_tflops']:5.0f}TF " + " ".join(cells))
    print("cells: best cuBLAS/ours of that configuration over the swept swizzles and splits; ! = a check failed")
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main())
