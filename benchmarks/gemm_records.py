#!/usr/bin/env python3
"""The plain-GEMM records the fused ops' backend choice reads (flux_shmem/kernels/backends.py), from
benchmarks/gemm_shapes.py runs (no GPU needed here):

    python3 benchmarks/gemm_records.py RUN.jsonl... [--out flux_shmem/kernels/records/<gpu>.json] [--commit C]

Each result row of kind 'heuristic' (our kernel with the chooser's configuration, as a fused op's decomposed path
runs it) becomes one record (family, dtype, layout, SMs, M, N, K, ours ms, cuBLAS ms); SMs and the GPU come from
the run's config record. Records already in --out (default: the shipped file of the runs' GPU) are kept unless a
run measured the same key again. The file says which runs it holds (date, command, torch, CUDA) so that a reader
can tell where each figure came from. Exit codes: 0 ok, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

from flux_shmem.kernels import backends  # noqa: E402


def records_of(path: str) -> tuple[dict, list[list]]:
    """(the run's config record, its rows as backends.FIELDS lists)."""
    config, rows = None, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "config":
                config = rec
            elif rec.get("type") == "result" and rec.get("kind") == "heuristic" and rec.get("ok", True):
                if config is None:
                    raise ValueError(f"{path}: a result before the config record")
                m, n, k = (int(x) for x in rec["shape"].split("x"))
                dt = rec.get("dtype") or config.get("dtype") or "bf16"
                rows.append([rec["family"], dt, rec["layout"], int(config["sm_count"]), m, n, k,
                             round(float(rec["ours_ms"]), 6), round(float(rec["cublas_ms"]), 6)])
    if config is None:
        raise ValueError(f"{path}: no config record (not a gemm_shapes.py --jsonl file?)")
    return config, rows


def merge(old: dict | None, runs: list[tuple[str, dict, list]], commit: str) -> dict:
    gpus = {cfg["device"] for _, cfg, _ in runs}
    if len(gpus) != 1:
        raise ValueError(f"runs of several GPU models {sorted(gpus)}: one records file per GPU model")
    gpu = gpus.pop()
    if old is not None and old.get("gpu") != gpu:
        raise ValueError(f"--out holds records of {old.get('gpu')!r}, the runs are of {gpu!r}")
    keyed = {tuple(r[:7]): r for r in (old or {}).get("rows", [])}
    sources = list((old or {}).get("sources", []))
    for path, cfg, rows in runs:
        for r in rows:
            keyed[tuple(r[:7])] = r
        sources.append({"file": os.path.basename(path), "rows": len(rows), "sm_count": cfg["sm_count"],
                        "torch": cfg.get("torch"), "cuda": cfg.get("cuda"), "suite": cfg.get("suite"),
                        "green": cfg.get("green"), "commit": commit})
    return {"format": backends.FORMAT, "version": backends.VERSION, "gpu": gpu, "fields": list(backends.FIELDS),
            "sources": sources, "rows": [keyed[k] for k in sorted(keyed)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="gemm_shapes.py --jsonl files")
    p.add_argument("--out", default=None, help="records file (default: the shipped one of the runs' GPU)")
    p.add_argument("--commit", default="", help="the flux_shmem commit the runs measured")
    args = p.parse_args(argv)
    try:
        runs = [(path, *records_of(path)) for path in args.runs]
        gpu = runs[0][1]["device"]
        out = args.out or str(backends.RECORDS_DIR / f"{backends.gpu_slug(gpu)}.json")
        old = json.load(open(out)) if os.path.exists(out) else None
        doc = merge(old, runs, args.commit)
    except (OSError, ValueError, KeyError) as e:
        print(f"gemm_records.py: {e}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write('{"format": %s, "version": %d, "gpu": %s, "fields": %s,\n "sources": %s,\n "rows": [\n' % (
            json.dumps(doc["format"]), doc["version"], json.dumps(doc["gpu"]), json.dumps(doc["fields"]),
            json.dumps(doc["sources"])))
        f.write(",\n".join("  " + json.dumps(r) for r in doc["rows"]))
        f.write("\n]}\n")
    print(f"{out}: {len(doc['rows'])} records of {doc['gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
