"""Which library runs a plain GEMM (no communication), ours or cuBLAS, decided from measured records.

A fused op's decomposed path and its one-PE path multiply with whichever of our CUTLASS kernel and cuBLAS
(`torch.matmul`; `torch._scaled_mm` for fp8) ran faster for that shape on this GPU model at this SM count. The
records ship in the package, one file per GPU model (flux_shmem/kernels/records/<gpu>.json, written by
`benchmarks/gemm_records.py` from `benchmarks/gemm_shapes.py` runs), and $FLUX_SHMEM_GEMM_RECORDS may name one
more file (records of your own GPU, or of an SM budget the shipped ones lack), whose rows win. One record:

    (family, dtype, layout, SMs, M, N, K) -> our kernel's median ms (the chooser's configuration), cuBLAS's median ms

The rule (`choose`): ours where the records say it is at least MARGIN faster at this M (or, between two measured
M, at both), else cuBLAS; where the records lack the GPU, the SM count or the N x K, cuBLAS (what a user runs
without us). `ratio` is the planners' estimate of cuBLAS's time over ours at this M (interpolated in log M between
records; DEFAULT_RATIO without one), for the decomposed path's time in `auto` mode. Everything but the file
loading is a pure function of a snapshot of rows: a fused op takes PE 0's snapshot when it is built (agreed by
every PE with its planner inputs), so every PE decides alike.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ..errors import FluxShmemError

ENV_FORCE = "FLUX_SHMEM_PLAIN_GEMM"  # 'auto' (default: the records decide), 'ours' or 'cublas' (experiments, checks)
FORMAT = "flux_shmem.gemm_records"
VERSION = 1
ENV_EXTRA = "FLUX_SHMEM_GEMM_RECORDS"
FIELDS = ("family", "dtype", "layout", "sms", "m", "n", "k", "ours_ms", "cublas_ms")
OURS, CUBLAS = "ours", "cublas"
BACKENDS = (OURS, CUBLAS)
MARGIN = 0.03         # ours must have run this much faster than cuBLAS (run-to-run spread of either is ~1-2%)
DEFAULT_RATIO = 1.0   # cuBLAS time / ours where nothing was measured (the planner then sees no difference)
RECORDS_DIR = Path(__file__).resolve().parent / "records"

# A snapshot row: (layout, sms, m, ours_ms, cublas_ms) of one (family, dtype, n, k), sorted.
Row = Tuple[str, int, int, float, float]


class RecordsError(FluxShmemError):
    """A records file cannot be used."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """What runs one plain GEMM: 'ours' or 'cublas', why, and cuBLAS's time over ours there (the planner's)."""

    name: str
    reason: str
    ratio: float = DEFAULT_RATIO

    def describe(self) -> str:
        return f"{'our CUTLASS kernel' if self.name == OURS else 'cuBLAS'} ({self.reason})"


def gpu_slug(gpu: str) -> str:
    """The records file name of a GPU model: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def _rows(path: Path) -> Tuple[str, List[tuple]]:
    """(GPU model, rows as FIELDS tuples) of one records file; RecordsError naming the file and the fix."""
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise RecordsError(f"{path}: cannot read the GEMM records ({e})") from None
    except json.JSONDecodeError as e:
        raise RecordsError(f"{path}: not valid JSON ({e}): regenerate it with benchmarks/gemm_records.py") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise RecordsError(f"{path}: not a flux_shmem GEMM records file of version {VERSION} (\"format\": "
                           f"\"{FORMAT}\"): regenerate it with benchmarks/gemm_records.py, or unset {ENV_EXTRA}")
    if tuple(doc.get("fields", ())) != FIELDS or not isinstance(doc.get("gpu"), str):
        raise RecordsError(f"{path}: fields must be {list(FIELDS)} and \"gpu\" the GPU's name")
    out = []
    for i, row in enumerate(doc.get("rows", ())):
        ok = isinstance(row, list) and len(row) == len(FIELDS)
        if ok:
            fam, dt, lay, sms, m, n, k, ours, cub = row
            ok = (isinstance(fam, str) and dt in ("bf16", "fp16", "e4m3", "e4m3fast") and lay in ("kn", "nk") and
                  all(isinstance(x, int) and x > 0 for x in (sms, m, n, k)) and
                  all(isinstance(x, (int, float)) and x > 0 for x in (ours, cub)))
        if not ok:
            raise RecordsError(f"{path}: row {i} {row!r} is not [family, dtype, layout, SMs, M, N, K, ours ms, "
                               f"cuBLAS ms] with positive sizes and times")
        out.append(tuple(row))
    return doc["gpu"], out


@functools.lru_cache(maxsize=8)
def _load(gpu: str, extra: str) -> Dict[tuple, Dict[tuple, Tuple[float, float]]]:
    """{(family, dtype, n, k): {(layout, sms, m): (ours_ms, cublas_ms)}} of the shipped file for `gpu` and the extra
    file (its rows for this GPU win)."""
    table: Dict[tuple, Dict[tuple, Tuple[float, float]]] = {}
    paths = [RECORDS_DIR / f"{gpu_slug(gpu)}.json"]
    paths = [p for p in paths if p.is_file()] + ([Path(extra)] if extra else [])
    for path in paths:
        if not path.is_file():
            raise RecordsError(f"{ENV_EXTRA}={extra}: no such file (unset it, or point it at records written by "
                               f"benchmarks/gemm_records.py)")
        file_gpu, rows = _rows(path)
        if file_gpu != gpu:
            continue
        for fam, dt, lay, sms, m, n, k, ours, cub in rows:
            table.setdefault((fam, dt, n, k), {})[(lay, sms, m)] = (float(ours), float(cub))
    return table


def snapshot(gpu: Optional[str], family: str, dtype: str, n: int, k: int) -> Tuple[Row, ...]:
    """This GPU model's records of one (family, dtype, N, K), as a fused op agrees on them: sorted (layout, SMs, M,
    ours ms, cuBLAS ms) rows; () without a GPU name or records."""
    if not gpu:
        return ()
    table = _load(gpu, os.environ.get(ENV_EXTRA, "").strip())
    got = table.get((family, dtype, n, k), {})
    return tuple(sorted((lay, sms, m, ours, cub) for (lay, sms, m), (ours, cub) in got.items()))


def current_gpu() -> Optional[str]:
    """The current CUDA device's name, or None without torch or a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def forced() -> str:
    """$FLUX_SHMEM_PLAIN_GEMM: 'auto' (unset), 'ours' or 'cublas'; a fused op takes PE 0's value when it is built."""
    v = os.environ.get(ENV_FORCE, "").strip().lower() or "auto"
    if v not in ("auto",) + BACKENDS:
        raise ValueError(f"{ENV_FORCE}={v!r}: use 'auto' (the measured records decide), 'ours' or 'cublas'")
    return v


def choose(rows: Iterable[Row], m: int, layout: str, sms: int, *, what: str = "", force: str = "auto") -> Backend:
    """The backend of a plain GEMM with M = m, B layout `layout`, on `sms` SMs, from a `snapshot` (`force`: 'ours'
    or 'cublas' overrides the rule, as FLUX_SHMEM_PLAIN_GEMM does)."""
    pts = sorted((r[2], r[3], r[4]) for r in rows if r[0] == layout and r[1] == sms)
    shape = f"{what} " if what else ""
    if force != "auto":
        return Backend(force, f"{ENV_FORCE}={force}", _ratio(pts, m) if pts else DEFAULT_RATIO)
    if not pts:
        return Backend(CUBLAS, f"no record of {shape}{layout} on {sms} SMs: cuBLAS, the baseline")
    ms = [p[0] for p in pts]
    i = bisect.bisect_left(ms, m)
    if i < len(ms) and ms[i] == m:
        near = [pts[i]]
    elif 0 < i < len(ms):
        near = [pts[i - 1], pts[i]]
    else:
        side = "below" if i == 0 else "above"
        return Backend(CUBLAS, f"M = {m} is {side} the records of {shape}{layout} on {sms} SMs "
                               f"(M {ms[0]}..{ms[-1]}): cuBLAS, the baseline", _ratio(pts, m))
    ratio = _ratio(pts, m)
    speed = ", ".join(f"M = {p[0]}: cuBLAS {p[2] * 1e3:.0f} us, ours {p[1] * 1e3:.0f} us" for p in near)
    if all(p[2] >= p[1] * (1 + MARGIN) for p in near):
        return Backend(OURS, f"measured faster than cuBLAS by >= {MARGIN:.0%} ({speed}, {sms} SMs)", ratio)
    return Backend(CUBLAS, f"measured: {speed} ({sms} SMs)", ratio)


def _ratio(pts: List[tuple], m: int) -> float:
    """cuBLAS ms / ours ms at M = m: the record's, interpolated in log M between two, the nearest's outside."""
    ms = [p[0] for p in pts]
    i = bisect.bisect_left(ms, m)
    if i < len(ms) and ms[i] == m:
        return pts[i][2] / pts[i][1]
    if i == 0 or i == len(ms):
        p = pts[0] if i == 0 else pts[-1]
        return p[2] / p[1]
    (m0, o0, c0), (m1, o1, c1) = pts[i - 1], pts[i]
    t = (math.log(m) - math.log(m0)) / (math.log(m1) - math.log(m0))
    return math.exp((1 - t) * math.log(c0 / o0) + t * math.log(c1 / o1))
