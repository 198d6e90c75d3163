"""Tune the CUTLASS GEMMs on this GPU and record the results in the tuning cache the ops' chooser reads.

    python -m flux_shmem.tune --shapes 8192x1280x8192,16384x3584x8192 --layouts nk,kn
    python -m flux_shmem.tune --shapes-file shapes.txt --sm-count 124      # e.g. the SMs a fused op leaves the GEMM
    python -m flux_shmem.tune --check                                       # validate the cache file, print it

Shapes are per-GPU M x N x K (benchmarks/shapes.py lists the tensor-parallel ones; benchmarks/gemm_shapes.py tunes
a whole suite). The cache is $FLUX_SHMEM_TUNE_CACHE or $FLUX_SHMEM_CACHE/gemm_tune.json (--cache overrides);
entries are keyed by GPU name, SM count, CUDA version, dtype, layout and shape. Kernels missing from the build cache
are built on first use (nvcc; `python -m flux_shmem.build --config all` ahead of time avoids that). Exit codes: 0 ok,
1 an invalid cache file or a failed tuning, 2 bad arguments, 3 no GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part or part.startswith("#"):
            continue
        try:
            m, n, k = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad shape {part!r}: expected MxNxK, e.g. 8192x1280x8192") from None
        if min(m, n, k) <= 0:
            raise argparse.ArgumentTypeError(f"bad shape {part!r}: M, N and K must be positive")
        out.append((m, n, k))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flux_shmem.tune", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", type=_shapes, default=[], help="comma list of MxNxK")
    p.add_argument("--shapes-file", type=Path, help="file of MxNxK, one per line or comma-separated")
    p.add_argument("--layouts", default="nk,kn", help="kn (B [K, N]) and/or nk (B [N, K])")
    p.add_argument("--dtype", choices=("bf16", "fp16", "e4m3"), default="bf16",
                   help="operands (e4m3: per-tensor scales, B as [N, K], vs torch._scaled_mm; "
                        "FLUX_SHMEM_FP8_FAST_ACCUM=1 tunes the FP8FastAccum builds, kept apart in the cache)")
    p.add_argument("--sm-count", type=int, default=None, help="SMs the GEMM runs on (default: the device's)")
    p.add_argument("--family", choices=("gemm_rs", "ag_gemm"), default="gemm_rs",
                   help="kernel family measured (both share the mainloop; the choice serves both)")
    p.add_argument("--cache", type=Path, default=None, help="cache file (default: $FLUX_SHMEM_TUNE_CACHE or "
                                                            "$FLUX_SHMEM_CACHE/gemm_tune.json)")
    p.add_argument("--fresh", action="store_true", help="start a new cache file (replaces an invalid or stale one)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-candidates", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new shapes after this many seconds")
    p.add_argument("--check", action="store_true", help="validate the cache file and print its entries; no GPU")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    from .errors import FluxShmemError
    from .kernels import tune_cache

    path = args.cache or tune_cache.default_path()
    if args.check:
        try:
            entries = tune_cache.load(path)
        except tune_cache.TuneCacheError as e:
            print(f"flux_shmem.tune: {e}", file=sys.stderr)
            return 1
        print(f"{path}: {len(entries)} entries (format {tune_cache.FORMAT} v{tune_cache.VERSION})")
        for key, e in sorted(entries.items()):
            heur = f" heuristic {e.heuristic_ms * 1e3:.1f} us" if e.heuristic_ms else ""
            print(f"  {key}: {e.config} swizzle={e.swizzle} split={e.split} {e.ms * 1e3:.1f} us{heur}")
        return 0

    shapes = list(args.shapes) + (_shapes(args.shapes_file.read_text()) if args.shapes_file else [])
    layouts = [x for x in args.layouts.split(",") if x]
    if not shapes:
        p.error("give --shapes or --shapes-file (or --check)")
    if any(x not in ("kn", "nk") for x in layouts):
        p.error(f"--layouts takes kn and/or nk, got {args.layouts!r}")
    if args.dtype == "e4m3":
        if args.layouts == p.get_default("layouts"):
            layouts = ["nk"]  # fp8 wgmma reads K-major B only
        elif "kn" in layouts:
            p.error("--dtype e4m3 takes --layouts nk only (fp8 GEMMs read B as [N, K])")

    import torch
    if not torch.cuda.is_available():
        print("flux_shmem.tune: no CUDA device visible: tuning measures kernels on the GPU they will run on",
              file=sys.stderr)
        return 3
    from .kernels import tune
    sm_count = args.sm_count or torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    os.environ.pop("FLUX_SHMEM_TUNE", None)  # never recurse into tune-on-first-call
    if args.fresh:
        tune_cache.update(path, {}, fresh=True)
    t0, done, rc = time.time(), 0, 0
    for m, n, k in shapes:
        for lay in layouts:
            if args.budget_s is not None and time.time() - t0 > args.budget_s:
                print(f"flux_shmem.tune: budget of {args.budget_s:.0f} s reached after {done} of "
                      f"{len(shapes) * len(layouts)} shapes", file=sys.stderr)
                return rc
            try:
                res = tune.tune_shape(m, n, k, args.dtype, lay, sm_count, family=args.family, cache_path=path,
                                      rounds=args.rounds, max_candidates=args.max_candidates,
                                      verbose=not args.quiet)
            except FluxShmemError as e:
                print(f"flux_shmem.tune: {m}x{n}x{k} {lay}: {e}", file=sys.stderr)
                rc = 1
                continue
            e = res.entry
            gain = f", {e.heuristic_ms / e.ms:.3f}x the heuristic's" if e.heuristic_ms else ""
            print(f"{m}x{n}x{k} {args.dtype} {lay} sm{sm_count}: {e.config} swizzle={e.swizzle} split={e.split} "
                  f"{e.ms * 1e3:.1f} us{gain}", flush=True)
            done += 1
    print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
