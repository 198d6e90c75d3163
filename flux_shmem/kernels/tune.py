"""On-device GEMM tuner (needs a Hopper GPU): measure a few candidate (configuration, swizzle, split) for one shape
against each other and record the fastest in the tuning cache (tune_cache.py). CLI: `python -m flux_shmem.tune`.

Candidates come from the model (config.candidates): the heuristic's choice, the default, the best splits of each
configuration and swizzle 1 for the leaders, at most `max_candidates`. Each is first checked against cuBLAS
(torch.matmul; for e4m3 operands with per-tensor scales torch._scaled_mm, with use_fast_accum as the build's
FLUX_SHMEM_FP8_FAST_ACCUM) on a poisoned output; one that disagrees is reported and never chosen. Then all are timed with
`time_interleaved`: every candidate is a CUDA graph of back-to-back launches over rotated input sets (no host
launch cost in the figures, weights not left in L2), replayed in rounds that alternate the candidates' order, so
clock and power drift hit all alike; the figure is the median over rounds.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import FluxShmemError
from . import config as kconfig
from . import registry, tune_cache

REL_TOL = 1e-2  # bf16/fp16 outputs against cuBLAS's; e4m3 (bf16 out) against torch._scaled_mm's


@dataclasses.dataclass
class TuneResult:
    entry: tune_cache.Entry
    heuristic: kconfig.Choice
    times_ms: Dict[str, float]           # candidate label -> median ms
    rejected: Dict[str, str]             # candidate label -> why (wrong output, launch error)


def label(c: kconfig.Choice) -> str:
    return f"{c.config}/sw{c.swizzle}/sp{c.split}" + (f"/q{c.chunks}" if c.chunks else "")


def tune_candidates(m: int, n: int, k: int, sm_count: int, *, group_rows: Optional[int] = None,
                    configs: Optional[Sequence[str]] = None, max_candidates: int = 8,
                    dtype: str = "bf16") -> List[kconfig.Choice]:
    """The candidates worth measuring for one shape, the heuristic's choice first (e4m3: among the configurations
    its builds run from registers, kconfig.allowed_configs)."""
    dt = kconfig.dtype_name(dtype)
    configs = kconfig.allowed_configs(configs, dt)
    heur = kconfig.heuristic(m, n, k, dt, "nk", sm_count, group_rows, configs=configs)
    ranked = kconfig.candidates(m, n, k, sm_count, configs=configs, group_rows=group_rows, dtype=dt, chunks=None)
    out: List[kconfig.Choice] = [heur]

    def add(cfg: str, swizzle: int, split: int, why: str, chunks: int = 0) -> None:
        c = kconfig.Choice(cfg, swizzle, split, "candidate", why, chunks=chunks)
        if all(label(c) != label(o) for o in out):
            out.append(c)

    default = next((e for e in ranked if e.config.name == registry.default_for(dt) and e.split == 1), None)
    if default is not None:
        add(default.config.name, default.swizzle, 1, "default")
    per_config: Dict[str, int] = {}
    for e in ranked:  # the two best splits of every configuration, fastest first
        if per_config.get(e.config.name, 0) < 2:
            per_config[e.config.name] = per_config.get(e.config.name, 0) + 1
            add(e.config.name, e.swizzle, e.split, "model rank", e.chunks)
    leaders = list(out[:3])
    for c in leaders:  # swizzle 1 for the leaders: a wave along whole N rows instead of groups
        if c.swizzle != 1:
            add(c.config, 1, c.split, "swizzle 1", c.chunks)
    for c in leaders:  # aligned stream-K ranges against unaligned ones: the model's L2 sharing is a rough guess
        if c.chunks:
            add(c.config, c.swizzle, c.split, "unaligned stream-K", 0)
    return out[:max(2, max_candidates)]


def _graph(fn: Callable[[int], None], reps: int, nsets: int):
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (cuBLAS workspaces, our split-K workspace)
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i % nsets)
    return g


def time_interleaved(fns: Dict[str, Callable[[int], None]], nsets: int, *, rounds: int = 5,
                     target_ms: float = 4.0, max_reps: int = 64, graphs: bool = True) -> Dict[str, List[float]]:
    """Per-call device times (ms), one per round, of every fn(i) (i: input set index). Each fn becomes a CUDA graph
    of enough back-to-back calls to last about `target_ms`; rounds replay every graph once, in alternating order.
    graphs=False launches the calls themselves on the current stream instead (in a green context: a replayed
    graph's kernels were seen, 2026-12-07 on an H200, to run on every SM whatever the stream's context)."""
    import torch
    if not fns:
        return {}
    first = next(iter(fns.values()))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(2):
        first(i % nsets)
    torch.cuda.synchronize()
    start.record()
    first(0)
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(nsets, math.ceil(target_ms / one / nsets) * nsets)))
    if graphs:
        runs = {name: _graph(fn, reps, nsets).replay for name, fn in fns.items()}
    else:
        runs = {name: (lambda fn=fn: [fn(i % nsets) for i in range(reps)]) for name, fn in fns.items()}
    names = list(runs)
    for name in names:  # one untimed run each: clocks up, caches in their steady state
        runs[name]()
    torch.cuda.synchronize()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            start.record()
            runs[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    del runs
    return times


def rotation_count(m: int, n: int, k: int, elem_bytes: int = 2, *, l2_bytes: Optional[int] = None,
                   budget_bytes: Optional[int] = None) -> int:
    """Input sets to rotate so consecutive calls do not find their operands in L2 (2 to 8)."""
    import torch
    if l2_bytes is None:
        l2_bytes = int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size",
                               50 << 20))
    per_set = (m * k + k * n + m * n) * elem_bytes
    want = max(2, min(8, math.ceil(4 * l2_bytes / per_set)))
    if budget_bytes is not None:
        want = max(1, min(want, budget_bytes // per_set))
    return want


def make_inputs(m: int, n: int, k: int, dtype, layout: str, nsets: int, seed: int = 1234):
    """`nsets` (a, b, d) on the GPU: a [m, k], b [k, n] row-major ('kn') or the transpose of [n, k] ('nk').
    e4m3: (a, b, d, scale_a, scale_b), a and b quantized with per-tensor fp32 scales, d bf16 ('nk' only)."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    fp8 = dtype == torch.float8_e4m3fn
    if fp8 and layout != "nk":
        raise FluxShmemError(kconfig.FP8_LAYOUT_ERROR)
    src = torch.bfloat16 if fp8 else dtype
    sets = []
    for _ in range(nsets):
        a = torch.randn(m, k, device="cuda", dtype=src, generator=gen)
        b = (torch.randn(k, n, device="cuda", dtype=src, generator=gen) if layout == "kn" else
             torch.randn(n, k, device="cuda", dtype=src, generator=gen).t())
        if not fp8:
            sets.append((a, b, torch.empty(m, n, device="cuda", dtype=dtype)))
            continue
        (a8, sa), (w8, sb) = (_quantize(x) for x in (a, b.t()))
        sets.append((a8, w8.t(), torch.empty(m, n, device="cuda", dtype=torch.bfloat16), sa, sb))
    return sets


def _quantize(x):
    """(e4m3 tensor, fp32 per-tensor scale) with x ~= q * scale (amax mapped to e4m3's 448)."""
    import torch
    scale = (x.abs().amax().float() / 448.0).clamp(min=1e-12)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def relative_error(out, ref) -> float:
    import torch
    num = torch.linalg.vector_norm(out.float() - ref.float()).item()
    den = torch.linalg.vector_norm(ref.float()).item()
    r = num / den if den else (0.0 if num == 0 else math.inf)
    return r if r == r else math.inf


def ours_fn(family: str, choice: kconfig.Choice, sets, sm_count: int, dtype, layout: str):
    """fn(i) launching `choice` on input set i (parameter blocks made up front)."""
    import torch
    from . import gemm as kgemm
    g = kgemm.CutlassGemm.get(family, dtype, layout, choice.config)
    dev = torch.cuda.current_device()
    runs = []
    for a, b, d, *scales in sets:
        m, k = a.shape
        fp8 = {}
        if scales:  # e4m3: the scales as the kernel reads them (views of the set's tensors, kept alive by it)
            sa_v, sb_v, kind = kgemm.fp8_scales(a, b, *scales)
            fp8 = dict(scale_a=sa_v.data_ptr(), scale_b=sb_v.data_ptr(), scale_kind=kind)
        args = kgemm.plain_args(family, a.data_ptr(), b.data_ptr(), d.data_ptr(), 0, m, b.shape[1], k,
                                sm_count=sm_count, device_id=dev, choice=choice, **fp8)
        runs.append(g.prepare(args))
    return lambda i: runs[i]()


def cublas_fn(sets):
    """The vendor library on set i: torch.matmul, or torch._scaled_mm (cuBLASLt fp8) for e4m3 sets."""
    import torch
    from .registry import fp8_fast_accum
    fast = fp8_fast_accum()

    def fn(i: int) -> None:
        a, b, d, *scales = sets[i]
        if scales:
            d.copy_(torch._scaled_mm(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=d.dtype,
                                     use_fast_accum=fast))
        else:
            torch.matmul(a, b, out=d)
    return fn


def check_against(fn: Callable[[int], None], sets, ref) -> float:
    """Poison set 0's output, run fn on it, return the relative error against `ref`."""
    import torch
    sets[0][2].fill_(float("nan"))
    fn(0)
    torch.cuda.synchronize()
    return relative_error(sets[0][2], ref)


def tune_shape(m: int, n: int, k: int, dtype, layout: str, sm_count: int, *, family: str = "gemm_rs",
               device: Optional[tune_cache.DeviceKey] = None, group_rows: Optional[int] = None,
               configs: Optional[Sequence[str]] = None, max_candidates: int = 8, rounds: int = 4,
               cache_path=None, write: bool = True, verbose: bool = False) -> TuneResult:
    """Measure the candidates for one shape on `sm_count` SMs and (write=True) record the fastest."""
    import torch
    dt = kconfig.dtype_name(dtype)
    kconfig._check(m, n, k, dt, layout, sm_count)  # e4m3: 'nk' only
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn}[dt]
    if device is None:
        device = tune_cache.current_device(sm_count)
        if device is None:
            raise FluxShmemError("tuning needs a CUDA device (torch.cuda.is_available() is False)")
    cands = tune_candidates(m, n, k, sm_count, group_rows=group_rows, configs=configs, max_candidates=max_candidates,
                            dtype=dt)
    heur = dataclasses.replace(cands[0], source="heuristic")
    sets = make_inputs(m, n, k, tdtype, layout, rotation_count(m, n, k, 1 if dt == "e4m3" else 2))
    ref_fn = cublas_fn(sets)
    ref_fn(0)
    torch.cuda.synchronize()
    ref = sets[0][2].clone()
    fns: Dict[str, Callable[[int], None]] = {}
    by_label: Dict[str, kconfig.Choice] = {}
    rejected: Dict[str, str] = {}
    for c in cands:
        name = label(c)
        try:
            fn = ours_fn(family, c, sets, sm_count, tdtype, layout)
            err = check_against(fn, sets, ref)
        except FluxShmemError as e:
            rejected[name] = f"cannot launch: {e}"
            continue
        if not err < REL_TOL:
            rejected[name] = f"output differs from cuBLAS: relative error {err:.3g} >= {REL_TOL}"
            print(f"flux_shmem.tune: {m}x{n}x{k} {dt} {layout}: candidate {name} REJECTED: {rejected[name]}",
                  file=sys.stderr, flush=True)
            continue
        fns[name], by_label[name] = fn, c
    if not fns:
        raise FluxShmemError(f"tuning {m}x{n}x{k} {dt} {layout}: no candidate ran correctly: {rejected}")
    times = {name: statistics.median(t) for name, t in time_interleaved(fns, len(sets), rounds=rounds).items()}
    best = min(times, key=lambda nm: (times[nm], list(times).index(nm)))
    c = by_label[best]
    entry = tune_cache.Entry(c.config, c.swizzle, c.split, round(times[best], 6),
                             round(times[label(heur)], 6) if label(heur) in times else None, len(times), family,
                             tune_cache.now(), c.chunks)
    if verbose:
        for name in sorted(times, key=times.get):
            print(f"  {name:28s} {times[name] * 1e3:9.1f} us" + ("  <- best" if name == best else "")
                  + ("  (heuristic)" if name == label(heur) else ""), flush=True)
    if write:
        key = tune_cache.entry_key(device, registry.tuning_dtype(dt), layout, m, n, k)
        tune_cache.update(cache_path or tune_cache.default_path(), {key: entry})
    del sets, ref
    return TuneResult(entry, heur, times, rejected)
