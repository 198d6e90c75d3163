"""How many SMs this process's CUDA context may use: the budget persistent kernels are sized from.

Under CUDA MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, or in a green context, a process gets only part of the GPU;
a persistent grid sized from the device's SM count then oversubscribes that share (measured: 0.80x of cuBLAS with 2
PEs at 50% each) and, worse, a kernel that waits for another one may never see it scheduled. The fused ops split
this budget between their GEMM and their communication kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import os

from . import partition


@dataclasses.dataclass(frozen=True)
class SmBudget:
    sms: int            # SMs this context may use
    device_sms: int     # SMs of the whole GPU
    source: str         # where `sms` comes from

    @property
    def share(self) -> float:
        return self.sms / self.device_sms


def budget_from(reported_sms: int, *, override: str | None = None, affinity_sms: int | None = None,
                mps_percentage: str | None = None, physical_sms: int | None = None) -> SmBudget:
    """The budget from what the machine says. `reported_sms`: the device's multiprocessor count as this context
    sees it (under MPS the driver already reports the client's share: 66 of an H200's 132 at 50%, seen
    2026-12-03); `affinity_sms`: the context's SM-count execution affinity (green contexts); `physical_sms`: the
    whole GPU's count (NVML), else inferred from the MPS percentage. FLUX_SHMEM_SMS overrides."""
    if reported_sms < 1:
        raise ValueError(f"reported_sms must be >= 1, got {reported_sms}")
    pct = None
    if mps_percentage:
        try:
            pct = float(mps_percentage)
        except ValueError:
            raise ValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps_percentage!r} is not a number") from None
        if not 0 < pct <= 100:
            raise ValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps_percentage!r} must be in (0, 100]")
    whole = physical_sms or (round(reported_sms * 100 / pct) if pct else reported_sms)
    whole = max(whole, reported_sms)
    if override:
        if not override.strip().isdigit() or not 1 <= int(override) <= whole:
            raise ValueError(f"FLUX_SHMEM_SMS={override!r}: must be an SM count in [1, {whole}]")
        return SmBudget(int(override), whole, "FLUX_SHMEM_SMS")
    sms, source = reported_sms, "device"
    if affinity_sms is not None and 0 < affinity_sms < sms:
        sms, source = affinity_sms, "context execution affinity"
    if sms < whole:
        source = f"{source}, MPS {pct:g}%" if pct else f"{source}, a share of the GPU"
    return SmBudget(sms, whole, source)


def _affinity_sms() -> int | None:
    """cuCtxGetExecAffinity(SM_COUNT) of the current context, or None where the driver does not say."""
    try:
        from cuda.bindings import driver
        err, param = driver.cuCtxGetExecAffinity(driver.CUexecAffinityType.CU_EXEC_AFFINITY_TYPE_SM_COUNT)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        return int(param.param.smCount.val)
    except Exception:  # noqa: BLE001 - older bindings, no context: fall back
        return None


def sm_budget(device: int) -> SmBudget:
    """The budget of this process on CUDA device `device` (its context current)."""
    part = partition.active(device)
    if part is not None:  # a green context of this PE's own SMs (FLUX_SHMEM_SM_PARTITION=green)
        return SmBudget(part.sms, max(part.device_sms, part.sms), part.describe())
    return _context_budget(device)


@functools.lru_cache(maxsize=None)
def _context_budget(device: int) -> SmBudget:
    import torch
    torch.cuda.set_device(device)
    torch.empty(1, device=f"cuda:{device}")  # make the primary context exist and be current
    reported = torch.cuda.get_device_properties(device).multi_processor_count
    return budget_from(reported, override=os.environ.get("FLUX_SHMEM_SMS"), affinity_sms=_affinity_sms(),
                       mps_percentage=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
