#!/usr/bin/env python3
"""Tune the CUTLASS GEMM configuration against cuBLAS on one GPU (no communication, no NVSHMEM).

Build variants here first (no GPU needed; each is a separate cached build of one family):

    python3 benchmarks/gemm_tune.py --build --variants all

then on the GPU machine, with the cache carried:

    python3 benchmarks/gemm_tune.py --variants all --swizzles 1,2,4,8 --layouts kn,nk

Each variant runs in its own process (FLUX_SHMEM_BUILD_DEFINES selects the build). Within a process, every shape
is timed in rounds that alternate cuBLAS (torch.matmul) and each swizzle of our kernel, so that clock and power
drift hit all candidates alike; each candidate's time is the median over all its timed iterations, and the ratio
cuBLAS / ours comes from the same rounds. Every candidate's output is compared with cuBLAS's first (poisoned
output, fresh random inputs). The last lines printed are a table: per shape and layout, cuBLAS ms and each
variant's best ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repo root (as run.py does)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

# name -> FLUX_SHMEM_BUILD_DEFINES (the first is the default build: no defines)
VARIANTS = {
    "t128x256c2x1": "",
    "t128x256c1x2": "FS_GEMM_CLUSTER_M=1 FS_GEMM_CLUSTER_N=2",
    "t256x128c2x1": "FS_GEMM_TILE_M=256 FS_GEMM_TILE_N=128",
    "t256x128c1x2": "FS_GEMM_TILE_M=256 FS_GEMM_TILE_N=128 FS_GEMM_CLUSTER_M=1 FS_GEMM_CLUSTER_N=2",
}
DEFAULT_SHAPES = ("8192x8192x8192,16384x4096x8192,8192x28672x8192,16384x28672x8192,16384x8192x28672,"
                  "8192x53248x8192,16384x12288x49152,8192x16384x53248")


def _env(variant: str) -> dict:
    env = dict(os.environ)
    env["FLUX_SHMEM_BUILD_DEFINES"] = VARIANTS[variant]
    return env


def _variants(text: str) -> list[str]:
    names = list(VARIANTS) if text == "all" else [v for v in text.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: one of {', '.join(VARIANTS)} or 'all'")
    return names


def build(variants: list[str], family: str) -> int:
    for v in variants:
        cmd = [sys.executable, "-m", "flux_shmem.build", "--family", family]
        print(f"[{v}] {' '.join(cmd)}  (FLUX_SHMEM_BUILD_DEFINES={VARIANTS[v]!r})", flush=True)
        rc = subprocess.call(cmd, env=_env(v))
        if rc:
            return rc
    return 0


def worker(args) -> int:
    import torch

    from benchmarks import timing
    from flux_shmem.kernels import abi
    from flux_shmem.kernels import gemm as kgemm

    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(1234)
    results = []
    for layout in args.layouts.split(","):
        g = kgemm.CutlassGemm(args.family, dtype, layout)
        args_type = kgemm.ARGS_TYPE[args.family]
        for shape in args.shapes.split(","):
            m, n, k = (int(x) for x in shape.split("x"))
            sets = []
            for _ in range(args.sets):
                a = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
                b = torch.randn(k, n, device="cuda", dtype=dtype, generator=gen) if layout == "kn" else \
                    torch.randn(n, k, device="cuda", dtype=dtype, generator=gen).t()
                sets.append((a, b, torch.empty(m, n, device="cuda", dtype=dtype)))
            launches = {}
            for sw in (int(s) for s in args.swizzles.split(",")):
                launches[f"sw{sw}"] = [
                    g.host.params(args_type(m=m, n=n, k=k, a=a.data_ptr(), b=b.data_ptr(), d=d.data_ptr(), bias=0,
                                            sm_count=sms, device_id=dev, swizzle=sw, ctx=abi.Ctx()))
                    for a, b, d in sets]

            def ours(i, key):
                blob, geo = launches[key][i]
                g.kernel.launch(blob, tuple(geo.grid), tuple(geo.block), smem=int(geo.smem_bytes),
                                cluster=tuple(geo.cluster))

            def cublas(i, _key):
                a, b, d = sets[i]
                torch.matmul(a, b, out=d)

            cands = [("cublas", cublas)] + [(key, ours) for key in launches]
            # Correctness: every candidate against cuBLAS on set 0, output poisoned first.
            ref = None
            errs = {}
            for key, fn in cands:
                sets[0][2].fill_(float("nan"))
                fn(0, key)
                torch.cuda.synchronize()
                if ref is None:
                    ref = sets[0][2].float()
                    continue
                errs[key] = timing.relative_error(sets[0][2], ref)
            times = {key: [] for key, _ in cands}
            idx = [(i,) for i in range(len(sets))]  # cuda_time rotates through these set indices
            for r in range(args.rounds):
                for key, fn in (cands if r % 2 == 0 else cands[::-1]):
                    times[key] += timing.cuda_time(lambda i, fn=fn, key=key: fn(i, key), idx,
                                                   warmup=args.warmup if r == 0 else 0, iters=args.iters)
            med = {key: statistics.median(t) for key, t in times.items()}
            flop = 2.0 * m * n * k
            for key in launches:
                rec = {"variant": args.variant, "layout": layout, "shape": shape, "cand": key,
                       "ours_ms": med[key], "cublas_ms": med["cublas"], "ratio": med["cublas"] / med[key],
                       "tflops": flop / med[key] / 1e9, "cublas_tflops": flop / med["cublas"] / 1e9,
                       "rel_err_vs_cublas": errs[key], "ok": errs[key] < 1e-2,
                       "spread": (min(times[key]), max(times[key]))}
                results.append(rec)
                print("RESULT " + json.dumps(rec), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="all", help=f"comma list of {', '.join(VARIANTS)}, or 'all'")
    p.add_argument("--family", default="gemm_rs", choices=("ag_gemm", "gemm_rs"))
    p.add_argument("--build", action="store_true", help="build the variants (no GPU needed) and exit")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of MxNxK")
    p.add_argument("--layouts", default="kn", help="kn (B [K,N]) and/or nk (B [N,K])")
    p.add_argument("--swizzles", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=4, help="timed iterations per candidate per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sets", type=int, default=2, help="input sets rotated (weights not left in L2)")
    p.add_argument("--jsonl", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    variants = _variants(args.variants)
    if args.build:
        return build(variants, args.family)
    if args.worker:
        return worker(args)
    rows, rc = [], 0
    for v in variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", v] + \
            [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--worker"]
        proc = subprocess.run(cmd, env=_env(v), capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                rows.append(json.loads(line[7:]))
        if proc.returncode:
            rc = 1
            print(f"[{v}] exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", flush=True)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    # Table: per (layout, shape): cuBLAS TFLOP/s and, per variant, best ratio (swizzle), all candidates checked.
    keys = sorted({(r["layout"], r["shape"]) for r in rows}, key=lambda t: (t[0], [int(x) for x in t[1].split("x")]))
    print(f"{'layout':6} {'shape':18} " + " ".join(f"{v:>22}" for v in variants))
    for lay, shape in keys:
        cells = []
        for v in variants:
            rs = [r for r in rows if r["variant"] == v and r["layout"] == lay and r["shape"] == shape]
            if not rs:
                cells.append(f"{'-':>22}")
                continue
            best = max(rs, key=lambda r: r["ratio"])
            bad = "" if all(r["ok"] for r in rs) else "!"
            cells.append(f"{best['ratio']:.3f} {best['cand']:>4} {best['cublas_tflops']:4.0f}TF{bad:1}".rjust(22))
        print(f"{lay:6} {shape:18} " + " ".join(cells))
    print("cells: best cuBLAS/ours over swizzles, that swizzle, cuBLAS TFLOP/s in that process; ! = a check failed")
    return rc


if __name__ == "__main__":
    sys.exit(main())
