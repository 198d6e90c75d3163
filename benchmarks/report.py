"""Turning measurements into records, a text table, JSON lines and PNG plots.

Pure Python apart from :func:`write_plots` (matplotlib, Agg backend, imported
lazily).  A *record* is one JSON object per problem; see ``README.md`` for the
field list.  ``impls`` maps an implementation name to::

    {"status": "ok" | "unavailable: <why>" | "error: <why>",
     "ms": median time (max over ranks of per-rank medians) or None,
     "rel_err": max relative error over ranks or None, "tol": bound, "ok": bool or None}
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import IO, Dict, Iterable, List, Optional, Sequence

from . import metrics
from . import model as _model
from .shapes import Problem

__all__ = [
    "FUSED_IMPLS",
    "COMM_IMPLS",
    "OVERLAP_IMPLS",
    "IMPL_LABELS",
    "build_record",
    "format_table",
    "JsonlWriter",
    "write_jsonl",
    "read_jsonl",
    "write_plots",
    "Progress",
]

# Implementations measured per fused problem, in table order.
FUSED_IMPLS = ("ours", "decomposed", "chunked", "symm_mem", "serial", "ours_gemm", "ours_gemm_split",
               "ours_fused_gemm_alone", "ours_comm", "cublas", "nccl")
# Implementations measured per standalone collective.
COMM_IMPLS = ("ours", "nccl")
# Fused implementations compared against the serial baseline.
OVERLAP_IMPLS = ("ours", "chunked", "symm_mem")
_GEMM_KINDS = ("ours_gemm", "ours_gemm_split", "cublas")
_COMM_KINDS = ("ours_comm", "nccl")

IMPL_LABELS = {
    "ours": "ours (fused)",
    "decomposed": "ours decomposed",
    "ours_gemm_split": "ours gemm_only, fused SMs",
    "ours_fused_gemm_alone": "ours fused GEMM, no reduce beside",
    "chunked": "NCCL+cuBLAS 2-stream",
    "symm_mem": "torch symm_mem",
    "serial": "NCCL+cuBLAS serial",
    "ours_gemm": "ours gemm_only",
    "ours_comm": "ours comm only",
    "cublas": "cuBLAS gemm only",
    "nccl": "NCCL comm only",
}
_COMM_LABELS = {"ours": "ours", "nccl": "NCCL"}
OP_TITLES = {
    "ag_gemm": "AllGather + GEMM",
    "gemm_rs": "GEMM + ReduceScatter",
    "all_gather": "AllGather",
    "reduce_scatter": "ReduceScatter",
}


def _ok_ms(impls: Dict[str, dict], name: str) -> Optional[float]:
    e = impls.get(name)
    if not e or e.get("status") != "ok":
        return None
    ms = e.get("ms")
    if ms is None or not (ms > 0) or not math.isfinite(ms):
        return None
    return float(ms)


def _first(impls: Dict[str, dict], names: Sequence[str]):
    for n in names:
        ms = _ok_ms(impls, n)
        if ms is not None:
            return ms, n
    return None, None


def build_record(
    problem: Problem,
    impls: Dict[str, dict],
    *,
    hw: Optional[_model.Hardware] = None,
    skipped: Optional[str] = None,
    extra: Optional[dict] = None,
) -> dict:
    """One result record: the problem, each implementation's numbers, derived metrics and the model.

    Derived per implementation: ``tflops`` (GEMM FLOPs per GPU / time) for
    fused and GEMM-only rows, ``bus_gbps`` (collective bytes, nccl-tests bus
    convention) for fused and communication rows.  Metrics (fused ops):
    ``t_gemm`` = ours gemm_only (else cuBLAS), ``t_comm`` = ours comm only
    (else NCCL; 0 at world 1, so overlap_eff is None and best is 1),
    ``t_serial`` = NCCL+cuBLAS serial (else, on a shared GPU where NCCL cannot run, our decomposed path); per
    fused implementation speedup = t_serial/t, overlap_eff = (t_serial - t)/t_comm, limit_attained
    = max(t_gemm, t_comm)/t; best_possible_speedup = (t_gemm+t_comm)/max(..); ``fused_vs_gemm_same_sms`` = ours /
    ours gemm_only on the fused call's GEMM SMs (1.0: the fused op took no longer than its GEMM alone);
    ``fused_gemm_vs_same_sms`` = how long the GEMM inside the fused call ran (its timed stages, ``fused_gemm_ms``)
    / the same gemm_only (1.0: the GEMM lost nothing to waiting for data or to the traffic beside it).
    """
    rec: dict = {"type": "result"}
    rec.update(problem.as_dict())
    if extra:
        rec.update(extra)
    if skipped:
        rec["skipped"] = skipped
        rec["impls"] = {}
        rec["metrics"] = {}
        rec["model"] = None
        return rec
    out_impls: Dict[str, dict] = {}
    for name, entry in impls.items():
        e = dict(entry)
        ms = _ok_ms(impls, name)
        fused_row = problem.is_fused and name in ("ours", "decomposed", "chunked", "symm_mem", "serial")
        if ms is not None and problem.is_fused and (fused_row or name in _GEMM_KINDS):
            e["tflops"] = metrics.tflops(problem.flops, ms)
        if ms is not None and (fused_row or name in _COMM_KINDS or not problem.is_fused):
            e["bus_gbps"] = metrics.bus_gbps(problem.comm_bytes, ms, problem.world)
        out_impls[name] = e
    rec["impls"] = out_impls
    m: dict = {}
    pred = None
    if problem.is_fused:
        t_gemm, gsrc = _first(impls, ("ours_gemm", "cublas"))
        t_comm, csrc = _first(impls, ("ours_comm", "nccl"))
        if problem.world == 1:  # nothing to communicate: the collectives are local copies
            t_comm, csrc = 0.0, "none (world 1)"
        t_serial, ssrc = _first(impls, ("serial", "decomposed"))
        m.update(t_gemm_ms=t_gemm, t_gemm_source=gsrc, t_comm_ms=t_comm, t_comm_source=csrc, t_serial_ms=t_serial,
                 t_serial_source=ssrc)
        t_ours, t_split = _ok_ms(impls, "ours"), _ok_ms(impls, "ours_gemm_split")
        m["fused_vs_gemm_same_sms"] = t_ours / t_split if t_ours is not None and t_split is not None else None
        t_inside = (impls.get("ours") or {}).get("fused_gemm_ms")
        m["fused_gemm_ms"] = t_inside
        m["fused_gemm_vs_same_sms"] = t_inside / t_split if t_inside is not None and t_split is not None else None
        m["speedup"], m["overlap_eff"], m["limit_attained"] = {}, {}, {}
        best = None
        if t_gemm is not None and t_comm is not None and max(t_gemm, t_comm) > 0:
            best = metrics.best_possible_speedup(t_gemm, t_comm)
        m["best_possible_speedup"] = best
        for name in OVERLAP_IMPLS + (("decomposed",) if ssrc == "serial" else ()):
            t = _ok_ms(impls, name)
            if t is None:
                continue
            if t_serial is not None:
                m["speedup"][name] = metrics.speedup(t_serial, t)
                if t_comm is not None:  # None when t_comm == 0 (world 1)
                    m["overlap_eff"][name] = metrics.overlap_efficiency(t_serial, t, t_comm)
            if t_gemm is not None and t_comm is not None and max(t_gemm, t_comm) > 0:
                m["limit_attained"][name] = metrics.limit_attained(t_gemm, t_comm, t)
        if hw is not None and t_gemm is not None:
            pred = _model.predict(
                problem.op, problem.m, problem.n, problem.k, problem.world, problem.elem_bytes, hw,
                gemm_tflops=metrics.tflops(problem.flops, t_gemm),
            ).as_dict()
    else:
        t_ours = _ok_ms(impls, "ours")
        t_nccl = _ok_ms(impls, "nccl")
        m["speedup"] = {}
        if t_ours is not None and t_nccl is not None:
            m["speedup"]["ours"] = metrics.speedup(t_nccl, t_ours)
        if hw is not None:
            pred = _model.predict(
                problem.op, problem.m, problem.n, problem.k, problem.world, problem.elem_bytes, hw
            ).as_dict()
    if pred is not None:
        t_ours = _ok_ms(impls, "ours")
        pred["err_pct"] = metrics.pct_error(pred["total_ms"], t_ours) if t_ours is not None else None
    rec["metrics"] = m
    rec["model"] = pred
    rec["checks_failed"] = sorted(n for n, e in impls.items() if e.get("ok") is False)
    return rec


# ----------------------------------------------------------------------------- table


def _f(x, fmt: str) -> str:
    if x is None:
        return "-"
    try:
        if isinstance(x, float) and not math.isfinite(x):
            return "-"
        return format(x, fmt)
    except (TypeError, ValueError):
        return str(x)


def _check_cell(e: dict, width: int = 40) -> str:
    st = e.get("status", "")
    if st != "ok":
        return st if len(st) <= width else st[: width - 3] + "..."
    if e.get("ok") is None:
        return "unchecked"
    tag = "ok" if e["ok"] else "FAIL"
    return f"{tag} {_f(e.get('rel_err'), '.1e')}<={_f(e.get('tol'), '.0e')}"


_FUSED_COLS = ["shape", "impl", "ms", "TFLOP/s", "bus GB/s", "speedup", "overlap", "best", "of best", "vs gemm@SMs",
               "model ms", "model err%", "check"]
_COMM_COLS = ["shape", "impl", "ms", "bus GB/s", "vs NCCL", "model ms", "model err%", "check"]


def _render(cols: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    left = {0, 1, len(cols) - 1}

    def line(cells):
        return "  ".join(
            (c.ljust(w) if i in left else c.rjust(w)) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    out = [line(cols), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return out


def format_table(records: Iterable[dict], header: Optional[str] = None) -> str:
    """Human-readable table, one section per op, one row per implementation."""
    records = [r for r in records if r.get("type", "result") == "result"]
    lines: List[str] = []
    if header:
        lines.append(header)
    for op in ("ag_gemm", "gemm_rs", "all_gather", "reduce_scatter"):
        recs = [r for r in records if r.get("op") == op]
        if not recs:
            continue
        fused = op in ("ag_gemm", "gemm_rs")
        rows: List[List[str]] = []
        for r in recs:
            shape = f"{r.get('label', '')} {r.get('shape', '')}".strip()
            if r.get("skipped"):
                rows.append([shape, "-", *(["-"] * ((len(_FUSED_COLS) if fused else len(_COMM_COLS)) - 3)), "skipped: " + r["skipped"]])
                continue
            impls = r.get("impls", {})
            m = r.get("metrics", {}) or {}
            pred = r.get("model") or {}
            first = True
            order = FUSED_IMPLS if fused else COMM_IMPLS
            for name in order + tuple(n for n in impls if n not in order):
                if name not in impls:
                    continue
                e = impls[name]
                is_ours = name == "ours"
                model_ms = _f(pred.get("total_ms"), ".3f") if is_ours and pred else ""
                model_err = _f(pred.get("err_pct"), "+.1f") if is_ours and pred else ""
                if fused:
                    if name in m.get("speedup", {}):
                        sp = m.get("speedup", {}).get(name)
                        ov = m.get("overlap_eff", {}).get(name)
                        la = m.get("limit_attained", {}).get(name)
                        cells_sp = _f(sp, ".2f") + "x" if sp is not None else "-"
                        cells_ov = _f(ov * 100 if ov is not None else None, ".0f") + ("%" if ov is not None else "")
                        cells_la = _f(la * 100 if la is not None else None, ".0f") + ("%" if la is not None else "")
                    elif name == m.get("t_serial_source", "serial") and e.get("status") == "ok":
                        cells_sp, cells_ov, cells_la = "1.00x", "", ""
                    else:
                        cells_sp, cells_ov, cells_la = "", "", ""
                    best = m.get("best_possible_speedup")
                    cells_best = (_f(best, ".2f") + "x") if (is_ours and best is not None) else ""
                    row = [
                        shape if first else "",
                        IMPL_LABELS.get(name, name),
                        _f(e.get("ms"), ".3f") if e.get("status") == "ok" else "-",
                        _f(e.get("tflops"), ".1f") if "tflops" in e else "",
                        _f(e.get("bus_gbps"), ".1f") if "bus_gbps" in e else "",
                        cells_sp,
                        cells_ov,
                        cells_best,
                        cells_la,
                        _f(m.get("fused_vs_gemm_same_sms"), ".3f") if is_ours else "",
                        model_ms,
                        model_err,
                        _check_cell(e),
                    ]
                else:
                    sp = m.get("speedup", {}).get(name) if is_ours else None
                    row = [
                        shape if first else "",
                        _COMM_LABELS.get(name, name),
                        _f(e.get("ms"), ".3f") if e.get("status") == "ok" else "-",
                        _f(e.get("bus_gbps"), ".1f") if "bus_gbps" in e else "",
                        (_f(sp, ".2f") + "x") if sp is not None else "",
                        model_ms,
                        model_err,
                        _check_cell(e),
                    ]
                rows.append(row)
                first = False
        lines.append("")
        lines.append(f"== {OP_TITLES[op]} ==")
        lines.extend(_render(_FUSED_COLS if fused else _COMM_COLS, rows))
        if fused:
            lines.extend(_stage_lines(recs))
    return "\n".join(lines) + "\n"


def _stage_lines(recs: Sequence[dict]) -> List[str]:
    """Under a fused table: per shape, the fused call's stages (median ms from its start) and how long its GEMM
    ran against gemm_only on the same SMs."""
    out = []
    for r in recs:
        e = (r.get("impls") or {}).get("ours") or {}
        st, m = e.get("stages_ms"), r.get("metrics") or {}
        if e.get("stages_error"):
            out.append(f"  stages {r.get('shape', '')}: not measured ({e['stages_error']})")
        if not st:
            continue
        inside = ""
        if m.get("fused_gemm_ms") is not None:
            vs = m.get("fused_gemm_vs_same_sms")
            inside = f"; GEMM inside {m['fused_gemm_ms']:.3f} ms" + (
                f" = {vs:.3f}x gemm_only on the fused SMs" if vs is not None else "")
        out.append(f"  stages {r.get('shape', '')} (ms from call start): "
                   + ", ".join(f"{lab} {t:.3f}" for lab, t in st.items()) + inside)
    return out


# ----------------------------------------------------------------------------- JSON lines


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


class JsonlWriter:
    """Appends one JSON object per line, flushed after each (a crash keeps what was done)."""

    def __init__(self, path: str):
        self.path = path
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._fh: Optional[IO[str]] = open(path, "w", encoding="utf-8")

    def write(self, obj: dict) -> None:
        assert self._fh is not None, "writer is closed"
        self._fh.write(json.dumps(_jsonable(obj), sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_jsonl(path: str, objs: Iterable[dict]) -> None:
    with JsonlWriter(path) as w:
        for o in objs:
            w.write(o)


def read_jsonl(path: str) -> List[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ----------------------------------------------------------------------------- plots


def _xlabel(r: dict) -> str:
    return f"{r.get('label', '')}\n{r.get('shape', '')}"


def write_plots(records: Iterable[dict], plot_dir: str, title_suffix: str = "") -> List[str]:
    """PNG plots per op into ``plot_dir``; returns the paths written.

    Fused ops: ``<op>_speedup.png`` (speedup over NCCL+cuBLAS serial, ours and
    each overlapped baseline, with the best possible speedup marked) and
    ``<op>_overlap.png`` (overlap efficiency).  Collectives:
    ``<op>_bandwidth.png`` (bus GB/s, ours vs NCCL).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    records = [r for r in records if r.get("type", "result") == "result" and not r.get("skipped")]
    os.makedirs(plot_dir, exist_ok=True)
    written: List[str] = []
    suffix = f" ({title_suffix})" if title_suffix else ""

    def bars(ax, recs, series, getter):
        n = len(series)
        width = 0.8 / max(n, 1)
        xs = list(range(len(recs)))
        for i, name in enumerate(series):
            vals = [getter(r, name) for r in recs]
            vals = [float("nan") if v is None else v for v in vals]
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], vals, width, label=IMPL_LABELS.get(name, name))
        ax.set_xticks(xs)
        ax.set_xticklabels([_xlabel(r) for r in recs], fontsize=7, rotation=0)
        return xs

    for op in ("ag_gemm", "gemm_rs"):
        recs = [r for r in records if r.get("op") == op]
        if not recs:
            continue
        width_in = max(6.0, 1.1 * len(recs) + 2)
        # speedup
        fig, ax = plt.subplots(figsize=(width_in, 4.2))
        xs = bars(ax, recs, OVERLAP_IMPLS, lambda r, n: (r.get("metrics") or {}).get("speedup", {}).get(n))
        best = [(r.get("metrics") or {}).get("best_possible_speedup") for r in recs]
        bx = [x for x, b in zip(xs, best) if b is not None]
        by = [b for b in best if b is not None]
        if bx:
            ax.scatter(bx, by, marker="_", s=900, color="black", zorder=3, label="best possible")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_ylabel("speedup over NCCL+cuBLAS serial")
        ax.set_title(f"{OP_TITLES[op]}: speedup{suffix}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(plot_dir, f"{op}_speedup.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        # overlap efficiency
        fig, ax = plt.subplots(figsize=(width_in, 4.2))
        bars(
            ax,
            recs,
            OVERLAP_IMPLS,
            lambda r, n: (lambda v: None if v is None else 100.0 * v)(
                (r.get("metrics") or {}).get("overlap_eff", {}).get(n)
            ),
        )
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.axhline(100.0, color="gray", lw=0.8, ls="--")
        ax.set_ylabel("overlap efficiency (% of comm hidden)")
        ax.set_title(f"{OP_TITLES[op]}: overlap efficiency{suffix}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(plot_dir, f"{op}_overlap.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for op in ("all_gather", "reduce_scatter"):
        recs = [r for r in records if r.get("op") == op]
        if not recs:
            continue
        fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(recs) + 2), 4.2))
        bars(ax, recs, COMM_IMPLS, lambda r, n: (r.get("impls", {}).get(n) or {}).get("bus_gbps"))
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{OP_TITLES[op]}: bandwidth{suffix}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(plot_dir, f"{op}_bandwidth.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ----------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, stream: Optional[IO[str]] = None, enabled: bool = True, width: int = 24):
        self.total = max(int(total), 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, label: str = "") -> None:
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {self.done}/{self.total} {label}"
        if self._tty:
            self.stream.write("\r" + text[:150].ljust(80))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
