"""The plain GEMM (no communication) at kernel level: out = a @ b (+ bias) with our CUTLASS kernel, the configuration
the chooser's (kernels/config.py), or, with FLUX_SHMEM_TUNE=1, measured first for a shape the tuning cache lacks.

    from flux_shmem.kernels import plain
    d = plain.gemm(a, w.t(), bias)                     # or choice=config.choose(...)

The tuner sits above the chooser (tune.py imports config and gemm, neither imports it); this module, above both,
is where a first call may tune.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from ..errors import FluxShmemError
from . import config
from . import gemm as kgemm
from . import registry, tune, tune_cache

ENV_TUNE = "FLUX_SHMEM_TUNE"


def tune_missing(m: int, n: int, k: int, dtype, layout: str, sm_count: int) -> Optional[tune_cache.Entry]:
    """FLUX_SHMEM_TUNE=1: measure a shape the tuning cache lacks now (not inside a CUDA-graph capture) and record it
    (the chooser then finds it); None when the variable is unset, the shape is cached, or tuning failed (reported:
    the heuristic decides, never a silent wrong kernel)."""
    if os.environ.get(ENV_TUNE, "") != "1":
        return None
    import torch
    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return None
    dt = config.dtype_name(dtype)
    device = tune_cache.current_device(sm_count)
    try:
        if tune_cache.shared().lookup(device, registry.tuning_dtype(dt), layout, m, n, k) is not None:
            return None
    except tune_cache.TuneCacheError as e:
        tune_cache.warn_once(str(e))
        return None
    print(f"flux_shmem: tuning GEMM {m}x{n}x{k} {dt} {layout} on {sm_count} SMs ({ENV_TUNE}=1)", file=sys.stderr,
          flush=True)
    try:
        return tune.tune_shape(m, n, k, dt, layout, sm_count, device=device).entry
    except FluxShmemError as e:
        print(f"flux_shmem: tuning {m}x{n}x{k} failed, using the heuristic: {e}", file=sys.stderr, flush=True)
        return None


def gemm(a, b, bias=None, *, out=None, family: str = "gemm_rs", choice: Optional[config.Choice] = None,
         sm_count: Optional[int] = None, stream=None, scale_a=None, scale_b=None, out_dtype=None):
    """out[m, n] = a[m, k] @ b[k, n] (+ bias[n]) with our CUTLASS kernel: the plain GEMM of `family` (no
    communication). b is row-major [k, n] or the transpose of a row-major [n, k] weight (w.t()). The configuration
    is `choice`, else config.choose() for this shape on `sm_count` SMs (default: all of the device's), which with
    FLUX_SHMEM_TUNE=1 first tunes a shape the tuning cache lacks (`tune_missing`). Returns out.

    fp8: a and b float8_e4m3fn (b the transpose of a row-major [n, k] weight), fp32 `scale_a` and `scale_b`
    (per-tensor or rowwise, `fp8_scales`), out = scale_a * scale_b * (a @ b) + bias in `out_dtype` (bfloat16)."""
    import torch
    fp8 = a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or b.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    scales = (None, None, 0)
    if fp8:
        scales = kgemm.fp8_scales(a, b, scale_a, scale_b, out_dtype=out_dtype, bias=bias)
    elif scale_a is not None or scale_b is not None:
        raise FluxShmemError(f"gemm: scale_a/scale_b are for float8_e4m3fn operands; a is {a.dtype}: drop them, or "
                             "quantize a and b to float8_e4m3fn")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise FluxShmemError(f"gemm: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply")
    if b.is_contiguous() and not fp8:
        layout = "kn"
    elif b.t().is_contiguous():
        layout = "nk"
    else:
        raise FluxShmemError("gemm: b must be row-major [K, N] or the transpose of a row-major [N, K] tensor")
    if not a.is_contiguous():
        raise FluxShmemError("gemm: a must be row-major (a.contiguous())")
    m, k = a.shape
    n = b.shape[1]
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    if choice is None:
        tune_missing(m, n, k, a.dtype, layout, sm_count)
        choice = config.choose(m, n, k, a.dtype, layout, sm_count)
    out_dt = torch.bfloat16 if fp8 else a.dtype
    if out is None:
        out = torch.empty((m, n), dtype=out_dt, device=a.device)
    elif out.dtype != out_dt or tuple(out.shape) != (m, n) or not out.is_contiguous():
        raise FluxShmemError(f"gemm: out must be a contiguous [{m}, {n}] {out_dt} tensor, got {tuple(out.shape)} "
                             f"{out.dtype}")
    sa, sb, kind = scales
    g = kgemm.CutlassGemm.get(family, a.dtype, layout, choice.config)
    g.launch(kgemm.plain_args(family, a.data_ptr(), b.data_ptr(), out.data_ptr(),
                        bias.data_ptr() if bias is not None else 0, m, n, k, sm_count=sm_count, device_id=dev,
                        choice=choice, scale_a=sa.data_ptr() if fp8 else 0, scale_b=sb.data_ptr() if fp8 else 0,
                        scale_kind=kind), stream=stream)
    return out
