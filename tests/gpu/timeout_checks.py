"""GPU checks, groups timeout_*: a wait that never completes reports which PE and signal, then raises or
traps."""
from __future__ import annotations

import os
import time

import torch

import flux_shmem
from common import check, rel_err


# ------------------------------------------------------------------------------------------------------------
def expect_timeout(rt, call, what: str, *needles: str) -> None:
    """call() must return after about the runtime timeout, and check_errors then raise a report that names this PE
    and contains every needle."""
    t0 = time.time()
    call()
    torch.cuda.synchronize()
    waited = time.time() - t0
    assert rt.timeout_s * 0.9 <= waited < rt.timeout_s + 20, f"{what} returned after {waited:.1f} s"
    try:
        flux_shmem.check_errors()
    except flux_shmem.SignalTimeoutError as e:
        msg = str(e)
        assert f"PE {rt.rank}" in msg and all(n in msg for n in needles), msg
    else:
        raise AssertionError(f"{what}: timeout not reported")


@check("timeout_split_k")
def timeout_split_k(rt):
    """A split-K lock that never reaches its count (the lock region of the GEMM's workspace poisoned) makes the
    kernel time out and report the lock instead of hanging (run alone: the process's error record is claimed)."""
    assert not rt.trap_on_timeout, "run with FLUX_SHMEM_ON_TIMEOUT=raise"
    os.environ["FLUX_SHMEM_GEMM_CONFIG"] = "config=128x256_c2x1,split=2"
    m, n, k = 8192, 1280, 8192  # a last wave of tiles the split applies to, on any SM count
    op = flux_shmem.AllGatherGEMM(m * rt.world_size, n, k, torch.bfloat16, mode="decomposed")
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    choice = op.gemm_choice(m, "nk", op.sms)
    assert choice.split == 2, choice
    out = op.gemm_only(a, b)
    torch.cuda.synchronize()
    assert rel_err(out, a.float() @ b.float()) < 1e-2
    ws = op.kernel("nk", choice.config)._workspace
    ws[: 64 * 1024].view(torch.int32).fill_(-1000)  # the locks: split s waits for lock >= s, forever now
    expect_timeout(rt, lambda: op.gemm_only(a, b), "the GEMM", "GEMM split-K lock", "needed >= 1")


@check("timeout_raise")
def timeout_raise(rt):
    assert not rt.trap_on_timeout, "run with FLUX_SHMEM_ON_TIMEOUT=raise"
    pool = flux_shmem.SignalPool(2)
    expect_timeout(rt, lambda: pool.wait(1, 42), "wait", "needed >= 42", "saw 0")  # nobody ever sets it


@check("timeout_trap")
def timeout_trap(rt):
    pool = flux_shmem.SignalPool(1)
    pool.wait(0, 7)
    torch.cuda.synchronize()  # the context dies here; the watchdog has printed the report
    raise AssertionError("unreachable: the wait should have trapped")


