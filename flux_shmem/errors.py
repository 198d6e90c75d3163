"""Exceptions raised by flux_shmem. Each message names the fix."""


class FluxShmemError(RuntimeError):
    """Base class of every flux_shmem error."""


class NotInitializedError(FluxShmemError):
    """A call needs `flux_shmem.init()` first."""


class NoGPUError(FluxShmemError):
    """No usable CUDA device (or no matching architecture) for this process."""


class BuildError(FluxShmemError):
    """nvcc is missing or a kernel failed to compile or link."""


class SymmetricMismatchError(FluxShmemError):
    """PEs called a collective with different arguments (shapes, dtypes, op parameters)."""


class SignalTimeoutError(FluxShmemError):
    """A device-side wait on a peer's signal exceeded the timeout."""
