"""What every GPU check module shares: the check registry (`check(group)` adds a function to CHECKS[group];
tests/gpu/checks.py runs them), Skip, and the helpers for references, poisoning and graph capture."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import flux_shmem  # noqa: E402,F401
import flux_shmem.runtime.pacing  # noqa: E402,F401

CHECKS: dict[str, list] = {}


class Skip(Exception):
    """A check that cannot run here (one PE, no MPS, ...): it prints `CHECK <name> skip: <reason>`, never ok."""


def check(group: str):
    def deco(fn):
        CHECKS.setdefault(group, []).append(fn)
        return fn
    return deco


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def capture(fn):
    """Run fn once on a side stream (loads kernels, fills host caches), then capture one call in a CUDA graph.
    Returns (graph, what the captured call returned)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def expect_errors(bad) -> None:
    """Each (call, exception type, word) of `bad` must raise that exception with the word in its message."""
    for fn, exc, word in bad:
        try:
            fn()
        except exc as e:
            assert word in str(e), f"message {e!r} lacks {word!r}"
        else:
            raise AssertionError(f"no {exc.__name__} for a bad call ({word})")


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)


def gathered_inputs(rt, shape, dtype, seed):
    """Every PE's input for this seed, built identically on all PEs (so each can compute the reference)."""
    xs = []
    for pe in range(rt.world_size):
        g = torch.Generator(device="cuda").manual_seed(seed * 1000 + pe)
        xs.append(torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype))
    return xs


# ------------------------------------------------------------------------------------------------------------
GEMM_SHAPES = [  # (m, n, k): tile-aligned, ragged in every dimension, M smaller than one tile per PE
    (1024, 512, 256), (1000, 264, 200), (256, 128, 64), (2 * 8, 72, 24), (4096, 1024, 512)]


def weight(k, n, layout, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "kn":
        return torch.randn((k, n), generator=g, device="cuda").to(dtype) / k ** 0.5
    return (torch.randn((n, k), generator=g, device="cuda").to(dtype) / k ** 0.5).t()  # a transposed weight
