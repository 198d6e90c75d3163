"""Argument checks shared by the ops. Every message says what was expected and how to fix the call."""
from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_dtype(name: str, dtype: torch.dtype, allowed=SUPPORTED_DTYPES) -> None:
    if dtype == torch.float8_e5m2 and torch.float8_e4m3fn in allowed:
        raise TypeError(f"{name}: float8_e5m2 operands are not supported (the fp8 kernels take float8_e4m3fn): "
                        "cast to torch.float8_e4m3fn with a scale for its range")
    if dtype in FP8_DTYPES and dtype not in allowed:
        raise NotImplementedError(f"{name}: fp8 ({dtype}) is not supported by this op; AllGatherGEMM and "
                                  "GEMMReduceScatter take float8_e4m3fn with scales, flux_shmem.kernels.plain.gemm(a, "
                                  "b, scale_a=..., scale_b=...) is a plain fp8 GEMM; or pass bfloat16 operands here")
    if dtype not in allowed:
        raise TypeError(f"{name}: dtype {dtype} is not supported; use one of "
                        f"{', '.join(str(d) for d in allowed)}")


def check_tensor(name: str, t, *, dtype: torch.dtype, device: int, ndim: int = 2) -> None:
    """A CUDA tensor of this PE's device with the op's dtype and rank, contiguous (row-major)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" or t.device.index != device:
        raise ValueError(f"{name} is on {t.device}, but this PE computes on cuda:{device}: move it with "
                         f"{name}.to('cuda:{device}')")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, the op was built for {dtype}: build another op or cast "
                        f"with {name}.to({dtype})")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major): pass {name}.contiguous()")
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must start on a 16-byte boundary (got address 0x{t.data_ptr():x}): pass a "
                         "fresh tensor or .clone() it")


def positive(name: str, v: int) -> int:
    if int(v) != v or v <= 0:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def capturing() -> bool:
    """Whether the current stream captures a CUDA graph (False where torch has no CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def not_capturing(what: str) -> None:
    """Schedule tables are made and copied to the device on a shape's first call: not possible inside CUDA-graph
    capture, so say how to fix it instead of failing inside torch."""
    if capturing():
        raise RuntimeError(f"{what} runs for the first time inside CUDA-graph capture: call it once with the same "
                           "shapes before capturing (its schedule tables are made and uploaded on first use)")
