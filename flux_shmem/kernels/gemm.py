"""The CUTLASS GEMM families (csrc/ag_gemm.cu, csrc/gemm_rs.cu) from Python.

Each family's host library (built beside the cubin, see `build.py`) fills the CUTLASS kernel's parameter block,
TMA descriptors included, from a plain C argument struct (csrc/include/flux_shmem/gemm_abi.h) and returns the
launch geometry; `CutlassGemm.launch` then passes those bytes as the kernel's single by-value parameter.

    g = CutlassGemm("ag_gemm", torch.bfloat16, "nk")
    args = FsAgGemmArgs(m=M, n=N, k=K, a=a.data_ptr(), b=w.data_ptr(), d=out.data_ptr(), sm_count=132, ...)
    g.launch(args)                       # on torch's current stream

Kernels: `fs_<family>_<dt>_<bl>` with dt in {bf16, fp16} and bl in {kn, nk}: A [M, K] row-major, B [K, N]
row-major ("kn") or [N, K] row-major ("nk"), D [M, N] row-major, fp32 accumulation, D = A @ B + bias[N].
Tiles are `tile_shape` (128 x 256) with clusters of `cluster_shape` (2 x 1) CTAs along M; M-tiles are visited in
the order of `m_tile_order` (the CTAs of a cluster take consecutive entries at the same N-tile), all N-tiles of
a group of `swizzle * cluster_m` consecutive entries before the next group (see `swizzle_for`).
"""
from __future__ import annotations

import collections
import ctypes
import os
from typing import Optional, Union

from ..errors import BuildError, FluxShmemError
from .abi import Ctx as FsCtx

c_u32, c_u64, c_i64, c_i32, c_ptr = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p

FAMILIES = ("ag_gemm", "gemm_rs")
B_LAYOUTS = ("kn", "nk")
DTYPE_NAMES = ("bf16", "fp16")


class FsLaunch(ctypes.Structure):
    _fields_ = [("grid", c_u32 * 3), ("block", c_u32 * 3), ("cluster", c_u32 * 3), ("smem_bytes", c_u32)]


class FsAgGemmArgs(ctypes.Structure):
    _fields_ = [("m", c_i64), ("n", c_i64), ("k", c_i64), ("a", c_ptr), ("b", c_ptr), ("d", c_ptr), ("bias", c_ptr),
                ("sm_count", c_i32), ("device_id", c_i32), ("chunk_flags", c_ptr), ("epoch", c_ptr),
                ("rows_per_shard", c_i32), ("chunk_rows", c_i32), ("chunks_per_shard", c_i32), ("wait", c_i32),
                ("m_tile_order", c_ptr), ("swizzle", c_i32), ("pad_", c_i32), ("ctx", FsCtx)]


class FsGemmRsArgs(ctypes.Structure):
    _fields_ = [("m", c_i64), ("n", c_i64), ("k", c_i64), ("a", c_ptr), ("b", c_ptr), ("d", c_ptr), ("bias", c_ptr),
                ("sm_count", c_i32), ("device_id", c_i32), ("rows_ready", c_ptr), ("bar", c_ptr),
                ("group_first", c_i32), ("group_size", c_i32), ("epoch", c_ptr), ("m_tile_order", c_ptr),
                ("swizzle", c_i32), ("pad_", c_i32), ("ctx", FsCtx)]


ABI_STRUCTS = {"FsCtx": FsCtx, "FsLaunch": FsLaunch, "FsAgGemmArgs": FsAgGemmArgs, "FsGemmRsArgs": FsGemmRsArgs}
ARGS_TYPE = {"ag_gemm": FsAgGemmArgs, "gemm_rs": FsGemmRsArgs}
GemmArgs = Union[FsAgGemmArgs, FsGemmRsArgs]

# Return codes of the `_params` functions (gemm_ext.cuh, fs::gemm::host).
PARAMS_ERRORS = {1: "invalid argument", 2: "misaligned operand", 3: "parameter buffer too small",
                 4: "CUTLASS cannot implement", 5: "workspace needed", 6: "TMA descriptor"}


SWIZZLES = (1, 2, 4, 8)


def swizzle_for(tiles_m: int, cluster_m: int, group_m_tiles: Optional[int] = None) -> int:
    """Scheduler swizzle s for a GEMM of `tiles_m` M-tiles: the CTAs walk groups of s * cluster_m consecutive
    entries of the M-tile order across all N-tiles, so a wave reads a squarer block of A and B rows from DRAM.

    8 unless the group would exceed `group_m_tiles` (default: all M-tiles). The fused ops pass the M-tiles of one
    shard / segment, so that the first wave of AllGather+GEMM needs local rows only and GEMM+ReduceScatter finishes
    segments one after another. Measured (benchmarks/gemm_tune.py, one H200, bf16, 8 LLM shapes x 2 B layouts,
    interleaved with cuBLAS; benchmarks/RESULTS.md): 8 within 2% of the best swizzle on every shape, 0.976-1.048
    of cuBLAS (geometric mean 1.018), where 1 loses up to 7% on the large-K shapes.
    FLUX_SHMEM_GEMM_SWIZZLE=1|2|4|8 forces a value (tuning)."""
    env = os.environ.get("FLUX_SHMEM_GEMM_SWIZZLE")
    if env:
        if not env.isdigit() or int(env) not in SWIZZLES:
            raise FluxShmemError(f"FLUX_SHMEM_GEMM_SWIZZLE={env!r}: use one of {SWIZZLES}")
        return int(env)
    limit = max(cluster_m, min(tiles_m, group_m_tiles) if group_m_tiles else tiles_m)
    s = SWIZZLES[-1]
    while s > 1 and s * cluster_m > limit:
        s //= 2
    return s


def kernel_name(family: str, dtype_name: str, b_layout: str) -> str:
    if family not in FAMILIES:
        raise FluxShmemError(f"GEMM family {family!r} unknown: use one of {FAMILIES}")
    if dtype_name not in DTYPE_NAMES:
        raise FluxShmemError(f"GEMM dtype {dtype_name!r} unsupported: use one of {DTYPE_NAMES}")
    if b_layout not in B_LAYOUTS:
        raise FluxShmemError(f"b_layout {b_layout!r} unknown: 'kn' (B is [K, N]) or 'nk' (B is [N, K])")
    return f"fs_{family}_{dtype_name}_{b_layout}"


def dtype_name(dtype) -> str:
    import torch
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in names:
        raise FluxShmemError(f"CUTLASS GEMMs take bfloat16 or float16 operands, not {dtype}")
    return names[dtype]


def check_abi(lib: ctypes.CDLL) -> None:
    """Raise BuildError unless every mirror's size and field offsets equal those the host library was built with."""
    lib.fs_abi_sizeof.restype = c_i64
    lib.fs_abi_sizeof.argtypes = [ctypes.c_char_p]
    lib.fs_abi_offsetof.restype = c_i64
    lib.fs_abi_offsetof.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    for name, st in ABI_STRUCTS.items():
        c_size = lib.fs_abi_sizeof(name.encode())
        if c_size != ctypes.sizeof(st):
            raise BuildError(f"{name}: C size {c_size} != ctypes size {ctypes.sizeof(st)}: update "
                             "flux_shmem/kernels/gemm.py to match csrc/include/flux_shmem/gemm_abi.h")
        for field, _ in st._fields_:
            c_off = lib.fs_abi_offsetof(name.encode(), field.encode())
            py_off = getattr(st, field).offset
            if c_off != py_off:
                raise BuildError(f"{name}.{field}: C offset {c_off} != ctypes offset {py_off}: update "
                                 "flux_shmem/kernels/gemm.py to match csrc/include/flux_shmem/gemm_abi.h")


class GemmHost:
    """The host functions of one GEMM kernel in a family's host library: parameter block + launch geometry.

    Needs no GPU to load; making parameters needs the NVIDIA driver (TMA descriptors) unless the arguments are
    rejected first (those errors are raised without a driver)."""

    def __init__(self, lib: ctypes.CDLL, family: str, dtype_name_: str, b_layout: str, *, cache_size: int = 64):
        self.lib, self.family = lib, family
        self.name = kernel_name(family, dtype_name_, b_layout)
        self.args_type = ARGS_TYPE[family]
        try:
            self._params = getattr(lib, self.name + "_params")
            size_fn = getattr(lib, self.name + "_params_size")
            self._last_error = lib.fs_gemm_last_error
        except AttributeError as e:
            raise BuildError(f"host library of {family} lacks {e}: rebuild with `python -m flux_shmem.build "
                             f"--family {family} --force`") from e
        self._params.restype = ctypes.c_int
        self._params.argtypes = [ctypes.POINTER(self.args_type), c_ptr, ctypes.c_size_t, ctypes.POINTER(FsLaunch)]
        size_fn.restype = ctypes.c_size_t
        self._last_error.restype = ctypes.c_char_p
        self.params_size = int(size_fn())
        for fn in ("fs_gemm_tile_m", "fs_gemm_tile_n", "fs_gemm_cluster_m", "fs_gemm_cluster_n"):
            getattr(lib, fn).restype = c_i32
        self.tile_shape = (int(lib.fs_gemm_tile_m()), int(lib.fs_gemm_tile_n()))
        self.cluster_shape = (int(lib.fs_gemm_cluster_m()), int(lib.fs_gemm_cluster_n()))
        self._cache: collections.OrderedDict[bytes, tuple[bytes, FsLaunch]] = collections.OrderedDict()
        self._cache_size = cache_size

    def params(self, args: GemmArgs) -> tuple[bytes, FsLaunch]:
        """(parameter block, launch geometry) for `args`; cached per distinct args (all fields are the key, since
        the TMA descriptors embed the pointers)."""
        if not isinstance(args, self.args_type):
            raise FluxShmemError(f"{self.name} takes {self.args_type.__name__}, not {type(args).__name__}")
        key = bytes(args)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        buf = ctypes.create_string_buffer(self.params_size)
        launch = FsLaunch()
        rc = self._params(ctypes.byref(args), buf, self.params_size, ctypes.byref(launch))
        if rc != 0:
            msg = (self._last_error() or b"").decode(errors="replace")
            raise FluxShmemError(f"{self.name}: {PARAMS_ERRORS.get(rc, 'error')} (code {rc}): {msg}")
        out = (buf.raw, launch)
        self._cache[key] = out
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out

    def tiles(self, m: int, n: int) -> tuple[int, int]:
        """(tiles_m, tiles_n) of an M x N output: the length of `m_tile_order` and the rows_ready increments per
        M-tile and call (gemm_rs)."""
        tm, tn = self.tile_shape
        return (m + tm - 1) // tm, (n + tn - 1) // tn

    def swizzle(self, m: int, group_m_tiles: Optional[int] = None) -> int:
        """`swizzle_for` this kernel's tiles and cluster, for an output of m rows."""
        return swizzle_for(-(-m // self.tile_shape[0]), self.cluster_shape[0], group_m_tiles)


class CutlassGemm:
    """One CUTLASS GEMM kernel of a loaded family (needs a Hopper GPU): `launch(args)` runs it on a stream."""

    def __init__(self, family: str, dtype, b_layout: str):
        from . import module as kmodule
        self.family, self.dtype, self.b_layout = family, dtype, b_layout
        name = kernel_name(family, dtype_name(dtype), b_layout)
        self.module = kmodule.load(family)
        if self.module.host_lib is None:
            raise BuildError(f"family {family} was built without its host library: rebuild it with "
                             f"`python -m flux_shmem.build --family {family} --force`")
        check_abi(self.module.host_lib)
        self.host = GemmHost(self.module.host_lib, family, dtype_name(dtype), b_layout)
        self.kernel = self.module.kernel(name)
        if self.kernel.param_size is not None and self.kernel.param_size != self.host.params_size:
            raise BuildError(f"{name}: the cubin takes {self.kernel.param_size} parameter bytes, the host library "
                             f"makes {self.host.params_size}: cubin and host library come from different builds; "
                             f"rebuild with `python -m flux_shmem.build --family {family} --force`")
        self.name = name
        self._max_ctas: Optional[int] = None

    @property
    def tile_shape(self) -> tuple[int, int]:
        return self.host.tile_shape

    @property
    def cluster_shape(self) -> tuple[int, int]:
        return self.host.cluster_shape

    def tiles(self, m: int, n: int) -> tuple[int, int]:
        return self.host.tiles(m, n)

    def swizzle(self, m: int, group_m_tiles: Optional[int] = None) -> int:
        return self.host.swizzle(m, group_m_tiles)

    def max_ctas(self, geo: FsLaunch) -> Optional[int]:
        """CTAs of this kernel that can be resident at once in this context (the driver's occupancy answer for its
        cluster shape, cached), or None where the driver cannot say."""
        if self._max_ctas is None:
            cl = tuple(geo.cluster)
            n = self.kernel.max_active_clusters(tuple(geo.block), int(geo.smem_bytes), cl)
            self._max_ctas = (n * cl[0] * cl[1] * cl[2]) if n else 0
        return self._max_ctas or None

    def launch(self, args: GemmArgs, stream=None) -> FsLaunch:
        """Fill (or reuse) the parameter block for `args` and launch on `stream` (default: torch's current). A
        persistent grid larger than what can be resident at once (occupancy query) is shrunk to fit: its CTAs
        would otherwise wait for each other's SMs."""
        blob, geo = self.host.params(args)
        cap = self.max_ctas(geo)
        if cap is not None and geo.grid[0] * geo.grid[1] * geo.grid[2] > cap and args.sm_count > cap:
            args = type(args).from_buffer_copy(args)
            args.sm_count = cap
            blob, geo = self.host.params(args)
        self.kernel.launch(blob, tuple(geo.grid), tuple(geo.block), smem=int(geo.smem_bytes), stream=stream,
                           cluster=tuple(geo.cluster))
        return geo
