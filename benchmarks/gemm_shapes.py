#!/usr/bin/env python3
"""Our GEMMs against cuBLAS on the per-GPU shard shapes of tensor parallelism (issue 11), one GPU, no NVSHMEM.

    python3 benchmarks/gemm_shapes.py --suite tp-shard-quick --budget-s 270 \\
        --cache $OUT/gemm_tune.json --jsonl $OUT/gemm_shapes.jsonl

For every shape and B layout: (1) unless the tuning cache has it, tune it (flux_shmem.kernels.tune, measured with
the gemm_rs kernel; the choice serves both families) and record it in the cache; (2) run cuBLAS (torch.matmul) and,
for every family, our plain GEMM with the heuristic's choice (no cache) and with the tuned one, each output first
checked against cuBLAS's with the output poisoned (NaN), then all timed together by
flux_shmem.kernels.tune.time_interleaved (CUDA graphs over rotated input sets, rounds in alternating order).
Identical choices are launched once and reported for both. Then (3) the fused AllGather+GEMM mainloop with every
chunk already arrived (ag_gemm, world 1, wait=1 on flags preset to the epoch) against the same kernel with wait=0,
on the same SM count (all SMs, and all but --comm-sms).

The last lines, one per family and layout, are

    tp-shard <family> <layout>: geomean G, min M at <shape> (heuristic)
    tp-shard <family> <layout>: geomean G, min M at <shape> (tuned)
    fused-mainloop ag_gemm <layout> sm<S>: min R at <shape>, geomean G (gemm_only ms / fused ms)

with G and M the cuBLAS ms / ours ms ratios (higher is better). FLUX_SHMEM_GEMM_PDL=1 launches our plain GEMMs with
programmatic dependent launch (recorded in the JSONL config record): compare a run with and one without.
--cublas-kernels records which kernel cuBLAS ran per shape (torch.profiler: tile, cluster, split-K / stream-K, as
`cublas_kernel` and `cublas_choice` in the result rows), to compare with our choice. --budget-s stops starting new shapes in time for
the fused phase (a header line says how many shapes ran). Exit codes: 0 ok, 1 an output check failed, 2 bad
arguments, 3 no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repo root (as run.py does)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks import shapes as _shapes  # noqa: E402

FUSED_SHAPES = "8192x1280x8192,8192x3584x8192,16384x7168x8192"
FAMILIES = ("ag_gemm", "gemm_rs")


def cublas_choice(name: str) -> str:
    """A short summary of a cuBLAS kernel name: its tile, cluster and K decomposition, e.g.
    'sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cluster2x1x1_..._execute_segment_k_off_kernel' ->
    'tile 128x256x64 cluster 2x1x1 segment_k off'; cuBLAS 12.8+'s nvjet kernels
    ('nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT') -> 'nvjet tile 256x128 k64x4 cluster 2x1 coopA' (tile, K-tile x
    stages, cluster, as their names read). Unknown names come back whole."""
    import re
    jet = re.match(r"nvjet_[a-z]+_(\d+x\d+)_(\d+x\d+)_(\d+x\d+)_(.*)$", name)
    if jet:
        flags = [f for f in jet.group(4).split("_") if f not in ("v", "h", "bz") and not re.fullmatch("[TN]{3}", f)]
        return " ".join([f"nvjet tile {jet.group(1)} k{jet.group(2)} cluster {jet.group(3)}"] + flags)
    parts = []
    for label, pat in (("tile", r"tilesize(\d+x\d+x\d+)"), ("cluster", r"cluster(\d+x\d+x\d+)"),
                       ("warpgroups", r"warpgroupsize(\d+x\d+x\d+)")):
        hit = re.search(pat, name)
        if hit:
            parts.append(f"{label} {hit.group(1)}")
    hit = re.search(r"segment_k_(on|off)", name)
    if hit:
        parts.append(f"segment_k {hit.group(1)}")
    for word in ("splitK", "splitk", "streamk", "stream_k", "sliced"):
        if word in name:
            parts.append(word.lower())
    return " ".join(parts) if parts else name


def cublas_kernels(fn) -> list[str]:
    """The CUDA kernels one call of fn launches (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(0)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary_lines(rows: list[dict], families, layouts) -> list[str]:
    """The issue's lines, from result rows {family, layout, kind, shape, ratio}."""
    out = []
    for fam in families:
        for lay in layouts:
            for kind in ("heuristic", "tuned"):
                rs = [r for r in rows if r["family"] == fam and r["layout"] == lay and r["kind"] == kind]
                if not rs:
                    continue
                worst = min(rs, key=lambda r: r["ratio"])
                out.append(f"tp-shard {fam} {lay}: geomean {geomean([r['ratio'] for r in rs]):.3f}, "
                           f"min {worst['ratio']:.3f} at {worst['shape']} ({kind})")
    return out


def fused_lines(rows: list[dict]) -> list[str]:
    out = []
    for lay, sm in sorted({(r["layout"], r["sm_count"]) for r in rows}):
        rs = [r for r in rows if r["layout"] == lay and r["sm_count"] == sm]
        worst = min(rs, key=lambda r: r["ratio"])
        out.append(f"fused-mainloop ag_gemm {lay} sm{sm}: min {worst['ratio']:.3f} at {worst['shape']}, geomean "
                   f"{geomean([r['ratio'] for r in rs]):.3f} (gemm_only ms / fused ms)")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="tp-shard-quick", choices=sorted(_shapes.SUITES))
    p.add_argument("--shapes", default=None, help="comma list of MxNxK instead of --suite")
    p.add_argument("--layouts", default="kn,nk")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--sm-count", type=int, default=None, help="SMs our GEMM runs on (default: the device's)")
    p.add_argument("--green", type=int, default=None, metavar="G",
                   help="run everything (cuBLAS too) in a green context of the first of G equal groups of the "
                        "device's SMs, as a PE of G sharing the GPU does (gpu_session.sh mps); our GEMM on its SMs")
    p.add_argument("--cache", default=None, help="tuning cache file (default: $FLUX_SHMEM_TUNE_CACHE or "
                                                 "$FLUX_SHMEM_CACHE/gemm_tune.json)")
    p.add_argument("--tune", choices=("missing", "all", "none"), default="missing",
                   help="tune shapes the cache lacks (default), every shape, or none (then only shapes the cache "
                        "has get a 'tuned' row: a quick heuristic-only pass over a whole suite)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tune-rounds", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new shapes after this many seconds (the fused phase still runs)")
    p.add_argument("--fused-shapes", default=FUSED_SHAPES, help="shapes of the fused-mainloop check ('' = none)")
    p.add_argument("--comm-sms", type=int, default=8, help="SMs a fused op leaves to communication")
    p.add_argument("--jsonl", default=None)
    p.add_argument("--cublas-kernels", action="store_true",
                   help="record cuBLAS's kernel per shape (torch.profiler; about a second per shape)")
    p.add_argument("--part", default=None, metavar="I/N",
                   help="run only shapes i, i+N, i+2N, ... of the suite (0 <= I < N): a long suite over several "
                        "device calls; --summarize then merges their JSONL files")
    p.add_argument("--summarize", nargs="+", default=None, metavar="JSONL",
                   help="print the summary lines of earlier runs' JSONL files (no GPU) and exit")
    args = p.parse_args(argv)
    if args.part is not None:
        try:
            i, n = (int(x) for x in args.part.split("/"))
            if not 0 <= i < n:
                raise ValueError
        except ValueError:
            p.error(f"--part takes I/N with 0 <= I < N, got {args.part!r}")
        args.part = (i, n)
    for lay in args.layouts.split(","):
        if lay not in ("kn", "nk"):
            p.error(f"--layouts takes kn and/or nk, got {lay!r}")
    for fam in args.families.split(","):
        if fam not in FAMILIES:
            p.error(f"--families takes {','.join(FAMILIES)}, got {fam!r}")
    return args


def part_of(shapes: list, part) -> list:
    """Shapes i, i+N, ... for part (i, N) (interleaved, so every part holds small and large problems)."""
    return shapes if part is None else shapes[part[0]::part[1]]


def summarize(paths) -> list[str]:
    """The summary lines over the result rows of several JSONL files (later rows of a shape/layout/family/kind win)."""
    rows, fused = {}, {}
    for path in paths:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("type") == "result":
                    rows[(rec["family"], rec["layout"], rec["kind"], rec["shape"])] = rec
                elif rec.get("type") == "fused_mainloop":
                    fused[(rec["layout"], rec["sm_count"], rec["shape"])] = rec
    rows_l = list(rows.values())
    fams = sorted({r["family"] for r in rows_l})
    lays = sorted({r["layout"] for r in rows_l})
    return [f"# {len({r['shape'] for r in rows_l})} shapes from {len(paths)} file(s)"] + \
        summary_lines(rows_l, fams, lays) + fused_lines(list(fused.values()))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        for text in summarize(args.summarize):
            print(text)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gemm_shapes.py: no CUDA device visible", file=sys.stderr)
        return 3
    from flux_shmem.errors import FluxShmemError
    from flux_shmem.kernels import config, plain, tune, tune_cache

    t0 = time.time()
    if os.environ.get(config.ENV_FORCE):
        print(f"gemm_shapes.py: warning: {config.ENV_FORCE} is set and overrides both the heuristic and the tuned "
              "choices", file=sys.stderr)
    os.environ.pop(plain.ENV_TUNE, None)
    if args.cache:
        os.environ[tune_cache.ENV_PATH] = args.cache
    cache_path = tune_cache.default_path()
    dev = torch.cuda.current_device()
    part = None
    if args.green:
        from flux_shmem.runtime import partition
        part = partition.create(dev, 0, args.green)  # torch's current stream is now the partition's
    sms = args.sm_count or (part.sms if part else torch.cuda.get_device_properties(dev).multi_processor_count)
    device = tune_cache.current_device(sms)
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    layouts, families = args.layouts.split(","), args.families.split(",")
    if args.shapes:
        shapes = [_shapes.ShardShape(m, n, k, ("custom",), ()) for m, n, k in _shapes.parse_shapes(args.shapes)]
    else:
        shapes = _shapes.suite(args.suite)
    shapes = part_of(shapes, args.part)
    fused = _shapes.parse_shapes(args.fused_shapes) if args.fused_shapes else []
    fused_reserve = 6.0 * len(fused) * len(layouts)
    jsonl = open(args.jsonl, "w") if args.jsonl else None

    def emit(rec: dict) -> None:
        if jsonl:
            jsonl.write(json.dumps(rec) + "\n")
            jsonl.flush()

    emit({"type": "config", "device": torch.cuda.get_device_name(dev), "sm_count": sms, "cuda": torch.version.cuda,
          "torch": torch.__version__, "suite": args.suite if not args.shapes else "custom", "cache": str(cache_path),
          "rounds": args.rounds, "pdl": os.environ.get("FLUX_SHMEM_GEMM_PDL", "") == "1", "dtype": args.dtype,
          "green": part.describe() if part else None})
    rows, bad, done = [], 0, 0
    total = len(shapes) * len(layouts)
    for s in shapes:
        for lay in layouts:
            if args.budget_s is not None and time.time() - t0 > args.budget_s - fused_reserve:
                break
            m, n, k = s.m, s.n, s.k
            t_pair = time.time()
            entry = tune_cache.TuneCache(cache_path).lookup(device, args.dtype, lay, m, n, k)
            if args.tune == "all" or (args.tune == "missing" and entry is None):
                try:
                    tune.tune_shape(m, n, k, args.dtype, lay, sms, device=device, cache_path=cache_path,
                                    rounds=args.tune_rounds)
                except FluxShmemError as e:  # reported; "tuned" then falls back to the heuristic
                    print(f"gemm_shapes.py: tuning {s.shape} {lay} failed: {e}", file=sys.stderr, flush=True)
            heur = config.choose(m, n, k, args.dtype, lay, sms, use_cache=False)
            tuned = config.choose(m, n, k, args.dtype, lay, sms, device=device)
            sets = tune.make_inputs(m, n, k, tdtype, lay, tune.rotation_count(m, n, k))
            cublas = tune.cublas_fn(sets)
            cublas(0)
            torch.cuda.synchronize()
            ref = sets[0][2].clone()
            ck = cublas_kernels(cublas) if args.cublas_kernels else []  # (a split-K reduce kernel too, if any)
            fns = {"cublas": cublas}
            errs = {}
            plan = []  # (family, kind, choice, fn label)
            # A "tuned" row only where the cache has the shape: --tune none over an empty cache would otherwise
            # report the heuristic twice, once as "tuned".
            kinds = (("heuristic", heur),) + ((("tuned", tuned),) if tuned.source != "heuristic" else ())
            for fam in families:
                for kind, ch in kinds:
                    name = f"{fam}:{tune.label(ch)}"
                    plan.append((fam, kind, ch, name))
                    if name not in fns:
                        fns[name] = tune.ours_fn(fam, ch, sets, sms, tdtype, lay)
                        errs[name] = tune.check_against(fns[name], sets, ref)
            times = tune.time_interleaved(fns, len(sets), rounds=args.rounds, graphs=part is None)
            med = {name: statistics.median(t) for name, t in times.items()}
            line = [f"{s.shape:18s} {lay} cuBLAS {med['cublas'] * 1e3:8.1f} us"]
            for fam, kind, ch, name in plan:
                ok = errs[name] < tune.REL_TOL
                bad += not ok
                rec = {"type": "result", "family": fam, "layout": lay, "kind": kind, "shape": s.shape,
                       "origins": list(s.origins), "config": ch.config, "swizzle": ch.swizzle, "split": ch.split,
                       "chunks": ch.chunks, "cublas_kernel": ck, "cublas_choice": [cublas_choice(x) for x in ck],
                       "source": ch.source, "reason": ch.reason, "ours_ms": med[name], "cublas_ms": med["cublas"],
                       "ratio": med["cublas"] / med[name], "rel_err_vs_cublas": errs[name], "ok": ok,
                       "spread_ms": [min(times[name]), max(times[name])]}
                rows.append(rec)
                emit(rec)
                line.append(f"{fam}/{kind[0]} {rec['ratio']:.3f}{'' if ok else ' FAIL'}")
            if ck:
                line.append("[cuBLAS " + "; ".join(cublas_choice(x) for x in ck) + "]")
            line.append(f"[h {tune.label(heur)} | t {tune.label(tuned)}] "
                        f"{time.time() - t_pair:.1f} s ({time.time() - t0:.0f} s)")
            print("  ".join(line), flush=True)
            del sets, ref, fns
            done += 1
    torch.cuda.empty_cache()

    fused_rows = []
    for m, n, k in fused:
        for lay in layouts:
            fused_rows += fused_mainloop(m, n, k, lay, tdtype, args.dtype, sms, args.comm_sms, device, args.rounds,
                                         emit)
    bad += sum(not r["ok"] for r in fused_rows)
    print(f"# {args.suite if not args.shapes else 'custom'}: {done} of {total} shape/layout pairs"
          + (" (budget reached)" if done < total else "") + f", {time.time() - t0:.0f} s, cuBLAS / ours, "
          f"{torch.cuda.get_device_name(dev)} sm{sms}; tuning cache {cache_path}")
    for text in summary_lines(rows, families, layouts) + fused_lines(fused_rows):
        print(text)
        emit({"type": "summary", "line": text})
    if bad:
        print(f"gemm_shapes.py: {bad} output check(s) FAILED (relative error vs cuBLAS >= {tune.REL_TOL})")
    if jsonl:
        jsonl.close()
    return 1 if bad else 0


def fused_mainloop(m, n, k, lay, tdtype, dt, sms, comm_sms, device, rounds, emit) -> list[dict]:
    """ag_gemm with wait=1 and every chunk flag at the epoch, against wait=0, same choice, same SM count."""
    import torch
    from flux_shmem.kernels import abi, config, tune
    from flux_shmem.kernels import gemm as kgemm
    out = []
    for sm in sorted({sms, sms - comm_sms}, reverse=True):
        choice = config.choose(m, n, k, dt, lay, sm, device=device)
        g = kgemm.CutlassGemm.get("ag_gemm", tdtype, lay, choice.config)
        tile_m = g.tile_shape[0]
        quarter = -(-m // 4)
        chunk_rows = -(-quarter // tile_m) * tile_m  # about four chunks in whole tiles, as AllGatherGEMM
        chunks = -(-m // chunk_rows)
        epoch = torch.ones(1, dtype=torch.int64, device="cuda")
        flags = torch.ones(chunks, dtype=torch.int64, device="cuda")  # every chunk "arrived" at epoch 1
        sets = tune.make_inputs(m, n, k, tdtype, lay, tune.rotation_count(m, n, k))
        ctx = abi.Ctx(err=0, timeout_ns=int(10e9), my_pe=0, n_pes=1, trap_on_timeout=1)
        fns = {}
        for wait in (0, 1):
            runs = []
            for a, b, d in sets:
                args = kgemm.FsAgGemmArgs(m=m, n=n, k=k, a=a.data_ptr(), b=b.data_ptr(), d=d.data_ptr(), bias=0,
                                          sm_count=sm, device_id=torch.cuda.current_device(),
                                          chunk_flags=flags.data_ptr(), epoch=epoch.data_ptr(), rows_per_shard=m,
                                          chunk_rows=chunk_rows, chunks_per_shard=chunks, wait=wait,
                                          swizzle=choice.swizzle, splits=choice.split, ctx=ctx)
                runs.append(g.prepare(args))
            fns[f"wait{wait}"] = (lambda r: (lambda i: r[i]()))(runs)
        ref_fn = tune.cublas_fn(sets)
        ref_fn(0)
        torch.cuda.synchronize()
        ref = sets[0][2].clone()
        errs = {name: tune.check_against(fn, sets, ref) for name, fn in fns.items()}
        times = tune.time_interleaved(fns, len(sets), rounds=rounds)
        med = {name: statistics.median(t) for name, t in times.items()}
        rec = {"type": "fused_mainloop", "shape": f"{m}x{n}x{k}", "layout": lay, "sm_count": sm,
               "config": choice.config, "swizzle": choice.swizzle, "split": choice.split,
               "gemm_only_ms": med["wait0"], "fused_ms": med["wait1"], "ratio": med["wait0"] / med["wait1"],
               "rel_err": errs, "ok": all(e < tune.REL_TOL for e in errs.values())}
        out.append(rec)
        emit(rec)
        print(f"fused {m}x{n}x{k} {lay} sm{sm} {tune.label(choice)}: gemm_only {med['wait0'] * 1e3:.1f} us, "
              f"fused (all arrived) {med['wait1'] * 1e3:.1f} us, ratio {rec['ratio']:.3f}"
              + ("" if rec["ok"] else f" FAIL {errs}"), flush=True)
        del sets, ref, fns
    return out


if __name__ == "__main__":
    sys.exit(main())
