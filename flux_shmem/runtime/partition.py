"""SM partitions for PEs that share one GPU: each PE's work runs in a CUDA green context on its own SMs.

Why: under CUDA MPS, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps how many SMs a client holds, not which. Two PEs that
start persistent GEMMs together then contend for SMs, and one PE's grid ran as a grid of half its size would
(benchmarks/RESULTS.md, 2026-12-03 fourth session). A green context made from one group of an equal split of the
device's SMs confines its streams' kernels to that group, so PEs on one GPU stop taking SMs from each other, as
PEs on separate GPUs never do.

Opt-in (FLUX_SHMEM_SM_PARTITION=green, read by init()): the partition's stream becomes torch's current stream of
this thread, and `side_stream()` makes the ops' other streams in the same green context. The split is the same
in every process (the driver's split of the whole device is deterministic), and PE i of the k sharing a GPU takes
group i. Pure driver calls (cuda.bindings); imports nothing of flux_shmem but errors.
"""
from __future__ import annotations

import dataclasses
import os

from ..errors import FluxShmemError

ENV = "FLUX_SHMEM_SM_PARTITION"
MODES = ("none", "green")


@dataclasses.dataclass(frozen=True)
class Partition:
    device: int
    index: int           # which group of the split this PE took
    groups: int          # how many PEs share the GPU (groups of the split)
    sms: int             # SMs of this PE's group
    device_sms: int      # SMs the split started from (the device as this process sees it)
    green_ctx: object    # CUgreenCtx (kept alive here)
    stream_handle: int   # CUstream of the partition's main stream

    def describe(self) -> str:
        return f"green context {self.index}/{self.groups}: {self.sms} of {self.device_sms} SMs"


_ACTIVE: dict[int, Partition] = {}


def mode_from_env() -> str:
    mode = os.environ.get(ENV, "none").strip().lower() or "none"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: must be one of {', '.join(MODES)}")
    return mode


def group_size(device_sms: int, groups: int, granularity: int = 8) -> int:
    """SMs per group of an equal split into `groups`: the largest multiple of `granularity` (Hopper's green
    context alignment) with groups * size <= device_sms."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    size = device_sms // groups // granularity * granularity
    if size < granularity:
        raise FluxShmemError(f"cannot split {device_sms} SMs into {groups} green contexts of at least {granularity} "
                             f"SMs each: put fewer PEs on one GPU or unset {ENV}")
    return size


def _check(result, what: str):
    from cuda.bindings import driver
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise FluxShmemError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} (green contexts "
                             f"need CUDA 12.4+ and a driver that allows them here; unset {ENV} to run without)")
    return rest[0] if len(rest) == 1 else tuple(rest)


def create(device: int, index: int, groups: int) -> Partition:
    """Make (once per device) the green context of group `index` of `groups` equal groups of the device's SMs, and
    make its stream torch's current stream on `device`."""
    if device in _ACTIVE:
        return _ACTIVE[device]
    if not 0 <= index < groups:
        raise ValueError(f"partition index {index} outside [0, {groups})")
    import torch
    from cuda.bindings import driver
    torch.cuda.set_device(device)
    torch.empty(1, device=f"cuda:{device}")  # the primary context first (the green context retains it)
    cu_dev = _check(driver.cuDeviceGet(device), "cuDeviceGet")
    whole = _check(driver.cuDeviceGetDevResource(cu_dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                   "cuDeviceGetDevResource(SM)")
    device_sms = int(whole.sm.smCount)
    gran = int(getattr(whole.sm, "smCoscheduledAlignment", 0) or 8)
    size = group_size(device_sms, groups, gran)
    result, got, _rest = _check(driver.cuDevSmResourceSplitByCount(groups, whole, 0, size),
                                "cuDevSmResourceSplitByCount")
    if int(got) < groups:
        raise FluxShmemError(f"the driver split {device_sms} SMs into {got} groups of {size}, not {groups}")
    mine = result[index]
    desc = _check(driver.cuDevResourceGenerateDesc([mine], 1), "cuDevResourceGenerateDesc")
    gctx = _check(driver.cuGreenCtxCreate(desc, cu_dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                  "cuGreenCtxCreate")
    stream = _check(driver.cuGreenCtxStreamCreate(gctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
                    "cuGreenCtxStreamCreate")
    part = Partition(device, index, groups, int(mine.sm.smCount), device_sms, gctx, int(stream))
    _ACTIVE[device] = part
    torch.cuda.set_stream(torch.cuda.ExternalStream(part.stream_handle, device=device))
    return part


def active(device: int) -> Partition | None:
    return _ACTIVE.get(device)


def side_stream(device: int, priority: int = 0):
    """A new torch stream for an op's side work: in this PE's green context when there is one, else a plain
    torch.cuda.Stream. (A stream of the primary context would run its kernels on any SM.)"""
    import torch
    part = _ACTIVE.get(device)
    if part is None:
        return torch.cuda.Stream(device=device, priority=priority)
    from cuda.bindings import driver
    handle = _check(driver.cuGreenCtxStreamCreate(part.green_ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING,
                                                  priority), "cuGreenCtxStreamCreate")
    stream = torch.cuda.ExternalStream(int(handle), device=device)
    stream._flux_handle = handle  # noqa: SLF001 - the stream lives as long as the torch object refers to it
    return stream


def release(device: int) -> None:
    """finalize(): forget the partition (torch's current stream goes back to the default stream)."""
    part = _ACTIVE.pop(device, None)
    if part is None:
        return
    import torch
    torch.cuda.set_stream(torch.cuda.default_stream(device))
