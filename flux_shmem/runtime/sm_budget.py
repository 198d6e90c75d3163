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


@dataclasses.dataclass(frozen=True)
class SmBudget:
    sms: int            # SMs this context may use
    device_sms: int     # SMs of the device
    source: str         # where `sms` comes from

    @property
    def share(self) -> float:
        return self.sms / self.device_sms


def budget_from(device_sms: int, *, override: str | None = None, affinity_sms: int | None = None,
                mps_percentage: str | None = None) -> SmBudget:
    """The budget from what the machine says, first match wins: FLUX_SHMEM_SMS, the context's execution affinity
    (green contexts; MPS where the driver reports it), CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, the device."""
    if device_sms < 1:
        raise ValueError(f"device_sms must be >= 1, got {device_sms}")
    if override:
        if not override.strip().isdigit() or not 1 <= int(override) <= device_sms:
            raise ValueError(f"FLUX_SHMEM_SMS={override!r}: must be an SM count in [1, {device_sms}]")
        return SmBudget(int(override), device_sms, "FLUX_SHMEM_SMS")
    if affinity_sms is not None and 0 < affinity_sms < device_sms:
        return SmBudget(affinity_sms, device_sms, "context execution affinity")
    if mps_percentage:
        try:
            pct = float(mps_percentage)
        except ValueError:
            raise ValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps_percentage!r} is not a number") from None
        if not 0 < pct <= 100:
            raise ValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps_percentage!r} must be in (0, 100]")
        # MPS grants whole TPCs (2 SMs); rounding down keeps a grid from exceeding what it gets.
        sms = max(2, int(device_sms * pct / 100.0) // 2 * 2)
        return SmBudget(min(sms, device_sms), device_sms, f"MPS active thread percentage {pct:g}")
    return SmBudget(device_sms, device_sms, "device")


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


@functools.lru_cache(maxsize=None)
def sm_budget(device: int) -> SmBudget:
    """The budget of this process on CUDA device `device` (its context current)."""
    import torch
    torch.cuda.set_device(device)
    torch.empty(1, device=f"cuda:{device}")  # make the primary context exist and be current
    device_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return budget_from(device_sms, override=os.environ.get("FLUX_SHMEM_SMS"), affinity_sms=_affinity_sms(),
                       mps_percentage=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
