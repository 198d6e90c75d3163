"""Load a kernel family's cubin with cuda.core, initialise NVSHMEM in it, and launch its kernels on torch's stream.

Every kernel of this project takes exactly one by-value parameter (a `const __grid_constant__` struct), so one
launch path serves all of them: the struct's bytes (a ctypes Structure mirroring the C struct, or a CUTLASS
parameter block filled by the family's host library) are passed through `cuLaunchKernelEx`. The parameter size is
checked against what the cubin declares, so a struct that drifted from its C twin fails loudly instead of running.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Sequence, Union

from ..errors import BuildError, NoGPUError
from . import build as kbuild

ArgBlock = Union[ctypes.Structure, bytes, bytearray]


def _driver():
    from cuda.bindings import driver
    return driver


def _check(result, what: str):
    """cuda.bindings returns (err, *values); raise on error, return the values."""
    err, *vals = result if isinstance(result, tuple) else (result,)
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return vals[0] if len(vals) == 1 else vals


def copy_async(dst: int, src: int, nbytes: int, stream) -> None:
    """Device-to-device copy of `nbytes` on `stream` (a torch stream) by the copy engine: no SM is used, so it
    proceeds while a persistent kernel holds every SM. `dst`/`src` may be peer mappings (NVLink)."""
    driver = _driver()
    _check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, driver.CUstream(stream.cuda_stream)),
           f"cuMemcpyDtoDAsync({nbytes} bytes)")


def write_value_async(addr: int, value: int, stream) -> None:
    """Write the 64-bit `value` at device address `addr` (may be a peer mapping) on `stream` (a torch stream),
    after a memory barrier for all of the stream's prior work (cuStreamWriteValue64 with default flags): whoever
    sees the value sees what the stream wrote before. Needs no SM; captured into CUDA graphs as a memop node."""
    driver = _driver()
    _check(driver.cuStreamWriteValue64(driver.CUstream(stream.cuda_stream), driver.CUdeviceptr(addr), driver.cuuint64_t(value),
                                       driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue64")


class StartEvent:
    """An event that fires once every block of one kernel launch has begun executing (CUDA's launch-completion
    event, CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT), for `Kernel.launch(started=...)`: a stream that waits on it
    runs its next kernel once that launch's blocks run. CUDA calls the trigger best effort, and under MPS no check
    could show it holding anything back, so it orders only launches that cannot deadlock either way (GEMM+RS's
    reduce kernel after its GEMM); a spinning consumer is gated on its producer's own start flag instead
    (AllGather.wait_started)."""

    def __init__(self) -> None:
        driver = _driver()
        self.handle = _check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def wait(self, stream) -> None:
        """Make `stream` (a torch stream) wait for the launch this event was last attached to."""
        driver = _driver()
        _check(driver.cuStreamWaitEvent(driver.CUstream(stream.cuda_stream), self.handle, 0), "cuStreamWaitEvent")

    def __del__(self) -> None:
        try:
            _driver().cuEventDestroy(self.handle)
        except Exception:  # interpreter shutdown
            pass


def device_arch(device_index: int | None = None) -> str:
    """The build arch for a CUDA device, e.g. '90a' for H100/H200 (wgmma kernels need the 'a' target)."""
    import torch
    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA device visible (torch.cuda.is_available() is False): flux_shmem kernels need "
                         "an NVIDIA Hopper GPU (H100/H200)")
    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"{major}{minor}"
    wanted = kbuild.archs_from_env()
    for a in wanted:
        if a.rstrip("a") == arch:
            return a
    raise NoGPUError(f"this GPU is sm_{arch} but kernels are built for {', '.join('sm_' + a for a in wanted)}: "
                     f"flux_shmem targets Hopper (sm_90a); set FLUX_SHMEM_ARCHS to include {arch} to try anyway")


class Kernel:
    """One `extern "C"` kernel of a loaded family."""

    def __init__(self, module: "Module", name: str):
        self.module, self.name = module, name
        try:
            self._k = module.obj.get_kernel(name)
        except Exception as e:  # cuda.core raises its own error type
            raise BuildError(f"kernel {name!r} not found in family {module.family!r}: {e}") from e
        driver = _driver()
        self._handle = driver.CUkernel(int(self._k.handle))
        self.param_size = self._param_size(driver, name)
        self._smem_set = 0
        self._configs: dict[tuple, tuple] = {}

    def _param_size(self, driver, name: str) -> int | None:
        """Size of the single parameter, or None where the driver cannot tell (cuKernelGetParamInfo: CUDA 12.4+)."""
        try:
            _, size = _check(driver.cuKernelGetParamInfo(self._handle, 0), f"cuKernelGetParamInfo({name})")
            second = driver.cuKernelGetParamInfo(self._handle, 1)[0]
        except RuntimeError as e:
            if "not found" in str(e):
                return None
            raise
        if second == driver.CUresult.CUDA_SUCCESS:
            raise BuildError(f"kernel {name} takes several parameters; flux_shmem kernels take one struct")
        return size

    def _set_smem(self, smem: int) -> None:
        if smem > 48 * 1024 and smem > self._smem_set:
            driver = _driver()
            import torch
            dev = driver.CUdevice(torch.cuda.current_device())
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuKernelSetAttribute(attr, smem, self._handle, dev), f"raise smem of {self.name}")
            self._smem_set = smem

    def max_active_clusters(self, block: Sequence[int], smem: int, cluster: Sequence[int],
                            stream: int = 0) -> int | None:
        """How many clusters of this kernel the driver can keep resident at once in the context of `stream` (a
        CUstream handle; 0: the current context), MPS share included, or None where it cannot say: persistent
        grids larger than this would not all run at once. The stream matters under green contexts: a function
        of the primary context would be sized for every SM of the device."""
        driver = _driver()
        self._set_smem(smem)
        try:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = tuple(cluster) + (1,) * (3 - len(cluster))
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = tuple(block) + (1,) * (3 - len(block))
            cfg.sharedMemBytes = smem
            cfg.hStream = driver.CUstream(stream)
            a = driver.CUlaunchAttribute()
            a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = tuple(cluster) + (1,) * (3 - len(cluster))
            cfg.attrs = [a]
            cfg.numAttrs = 1
            if stream:  # a context-less kernel: the driver takes the context from the stream
                func = driver.CUfunction(int(self._handle))
            else:
                func = _check(driver.cuKernelGetFunction(self._handle), f"cuKernelGetFunction({self.name})")
            n = _check(driver.cuOccupancyMaxActiveClusters(func, cfg), f"cuOccupancyMaxActiveClusters({self.name})")
        except RuntimeError:
            return None
        return int(n) if n else None

    def _config(self, grid: tuple, block: tuple, smem: int, stream: int, cluster: tuple | None,
                started: "StartEvent | None", pdl: bool = False) -> object:
        """The CUlaunchConfig of one launch geometry on one stream (made once: building it through the bindings on
        every launch was a measurable part of a call's host time)."""
        key = (grid, block, smem, stream, cluster, id(started) if started is not None else None, pdl)
        cfg = self._configs.get(key)
        if cfg is not None:
            return cfg[0]
        driver = _driver()
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = smem
        cfg.hStream = driver.CUstream(stream)
        attrs = []
        if cluster is not None and cluster != (1, 1, 1):
            a = driver.CUlaunchAttribute()
            a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster + (1,) * (3 - len(cluster))
            attrs.append(a)
        if started is not None:
            a = driver.CUlaunchAttribute()
            a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT
            a.value.launchCompletionEvent.event = started.handle
            a.value.launchCompletionEvent.flags = 0
            attrs.append(a)
        if pdl:
            a = driver.CUlaunchAttribute()
            a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        if len(self._configs) >= 256:  # streams come and go: keep the table bounded
            self._configs.clear()
        self._configs[key] = (cfg, started)  # the event is kept alive with the config that names it
        return cfg

    def launch(self, args: ArgBlock, grid: Sequence[int] | int, block: Sequence[int] | int, *, smem: int = 0,
               stream=None, cluster: Sequence[int] | None = None, started: "StartEvent | None" = None,
               pdl: bool = False) -> None:
        """Launch on `stream` (default: torch's current stream) with `args` as the kernel's single parameter.
        `started`: a StartEvent that fires once all blocks of this launch are running. `pdl`: programmatic
        dependent launch (the kernel may start before the previous kernel on the stream ends; it must wait with
        griddepcontrol.wait before reading what that kernel wrote, as CUTLASS's GEMMs here do)."""
        import torch
        blob = bytes(args)
        if self.param_size is not None and len(blob) != self.param_size:
            raise BuildError(f"{self.name}: argument block is {len(blob)} bytes, the cubin expects "
                             f"{self.param_size}: the Python mirror of the C struct is out of date")
        grid = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
        block = (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(block))
        if stream is None:
            stream = torch.cuda.current_stream()
        self._set_smem(smem)
        driver = _driver()
        buf = ctypes.create_string_buffer(blob, len(blob))
        ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        cfg = self._config(grid, block, smem, stream.cuda_stream, tuple(cluster) if cluster is not None else None,
                           started, pdl)
        _check(driver.cuLaunchKernelEx(cfg, self._handle, ctypes.addressof(ptrs), 0), f"launch {self.name}")


def load_into_context(library: int) -> int:
    """Load every kernel of a CUlibrary into the current context now; returns how many. Under CUDA's lazy loading
    (the default) a kernel is loaded at its first launch, and that load may wait for work already running in the
    context (the CUDA guide's lazy-loading deadlock): a fused call's first launch of its second kernel would then
    wait for its first kernel, which spins on signals that only the second one's peers raise."""
    driver = _driver()
    lib = driver.CUlibrary(library)
    count = _check(driver.cuLibraryGetKernelCount(lib), "cuLibraryGetKernelCount")
    kernels = _check(driver.cuLibraryEnumerateKernels(count, lib), "cuLibraryEnumerateKernels") if count else []
    for k in kernels:
        func = _check(driver.cuKernelGetFunction(k), "cuKernelGetFunction")
        _check(driver.cuFuncLoad(func), "cuFuncLoad")
    return int(count)


class Module:
    """A family's cubin (built or taken from the cache; GEMM families per kernel configuration), NVSHMEM-initialised
    when it uses NVSHMEM."""

    def __init__(self, family: str, config: str | None = None, fp8: bool = False):
        from cuda.core import ObjectCode
        self.family, self.config, self.fp8 = family, config, fp8
        art = kbuild.build(family, device_arch(), config=config, fp8=fp8)
        import torch
        torch.empty(1, device="cuda")  # the device's primary context must exist (and be current) to load
        self.obj = ObjectCode.from_cubin(art.cubin.read_bytes())
        if kbuild.uses_nvshmem(family):
            import nvshmem.core as nv
            self._nv_obj = nv.NvshmemKernelObject.from_obj(self.obj)
            nv.library_init(self._nv_obj)
        self.host_lib = ctypes.CDLL(str(art.host_lib)) if art.host_lib else None
        self._kernels: dict[str, Kernel] = {}
        load_into_context(int(self.obj.handle))

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name)
        return self._kernels[name]


def load(family: str, config: str | None = None, fp8: bool = False) -> Module:
    """The loaded module of a family (of one kernel configuration for the GEMM families; None = the default; `fp8`:
    their fp8 build); one per process, configuration and build. Families that use NVSHMEM need it initialised
    first; the GEMM families do not. Ops ask for their modules on every call, so the answer is cached by the
    arguments as given (resolving a configuration reads the family's source)."""
    key = (family, config if config is None or isinstance(config, str) else config.name, fp8)
    mod = _BY_ARGS.get(key)
    if mod is None:
        cfg = kbuild.resolve_config(family, config)
        mod = _BY_ARGS[key] = _load(family, cfg.name if cfg is not None else None, fp8)
    return mod


_BY_ARGS: dict[tuple, Module] = {}


@functools.lru_cache(maxsize=None)
def _load(family: str, config: str | None, fp8: bool = False) -> Module:
    return Module(family, config, fp8)


def _forget_all() -> None:
    """finalize(): forget every loaded module (a later init loads them again)."""
    _BY_ARGS.clear()
    _load.cache_clear()


load.cache_clear = _forget_all  # type: ignore[attr-defined]
