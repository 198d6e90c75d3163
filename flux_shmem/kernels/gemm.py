"""The CUTLASS GEMM families (csrc/ag_gemm.cu, csrc/gemm_rs.cu) from Python.

Each family's host library (built beside the cubin, see `build.py`, once per kernel configuration of
`registry.py`) fills the CUTLASS kernel's parameter block, TMA descriptors included, from a plain C argument struct
(csrc/include/flux_shmem/gemm_abi.h) and returns the launch geometry; `CutlassGemm.launch` then passes those bytes
as the kernel's single by-value parameter.

    choice = config.choose(M, N, K, "bf16", "nk", sm_count=132)       # configuration, swizzle, split
    g = CutlassGemm.get("ag_gemm", torch.bfloat16, "nk", choice.config)
    args = FsAgGemmArgs(m=M, n=N, k=K, a=a.data_ptr(), b=w.data_ptr(), d=out.data_ptr(), sm_count=132,
                        swizzle=choice.swizzle, splits=choice.split, ...)
    g.launch(args)                       # on torch's current stream; allocates the split-K workspace if needed

    d = gemm(a, b, bias)                 # the plain GEMM (no communication), configuration chosen for the shape
    d = gemm(a8, w8.t(), scale_a=sa, scale_b=sb)   # fp8: e4m3 operands, fp32 scales, bf16 out

Kernels: `fs_<family>_<dt>_<bl>` with dt in {bf16, fp16} and bl in {kn, nk}: A [M, K] row-major, B [K, N]
row-major ("kn") or [N, K] row-major ("nk"), D [M, N] row-major, fp32 accumulation, D = A @ B + bias[N]. The fp8
build of each family (build.py fp8=True) holds `fs_<family>_e4m3_nk` instead: e4m3 A [M, K] and B [N, K] (sm90
fp8 wgmma reads K-major operands only), bf16 D = scale_b * (scale_a * A @ B) + bias[N], fp32 scales in device
memory, each one float (per-tensor) or a vector (rowwise: scale_a[M], scale_b[N]; FsAgGemmArgs.scale_kind).
Tiles are the configuration's `tile_shape` with clusters of `cluster_shape` CTAs; M-tiles are visited in the order
of `m_tile_order` (the CTAs of a cluster take consecutive entries at the same N-tile), all N-tiles of a group of
`swizzle * cluster_m` consecutive entries before the next group. `splits` > 1 runs the last partial wave and the
whole wave before it as stream-K (cooperative configurations; an even share of their K-tiles per cluster, config.py
`tail_plan`), pieces of a tile reduced in a workspace the kernel leaves zeroed.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import os
from typing import Optional, Union

from ..errors import BuildError, FluxShmemError
from . import config as kconfig
from . import registry
from .abi import Ctx as FsCtx

c_u32, c_u64, c_i64, c_i32, c_ptr = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p

FAMILIES = ("ag_gemm", "gemm_rs")
B_LAYOUTS = ("kn", "nk")
DTYPE_NAMES = ("bf16", "fp16", "e4m3")
FP8_LAYOUTS = ("nk",)

# Fields added after the first release go at the end (issue 11: splits, workspace; issue 26: fp8 scales; issue 24:
# tail_chunks, in what was padding), in both structs alike.
_TAIL = [("splits", c_i32), ("tail_chunks", c_i32), ("workspace", c_ptr), ("workspace_bytes", c_u64),
         ("scale_a", c_ptr), ("scale_b", c_ptr), ("scale_kind", c_i32), ("pad2_", c_i32)]
SCALE_ROWWISE_A = 1  # scale_kind bits (gemm_abi.h FS_SCALE_ROWWISE_*): that scale is a vector, else one float
SCALE_ROWWISE_B = 2


class FsLaunch(ctypes.Structure):
    _fields_ = [("grid", c_u32 * 3), ("block", c_u32 * 3), ("cluster", c_u32 * 3), ("smem_bytes", c_u32)]


class FsAgGemmArgs(ctypes.Structure):
    _fields_ = [("m", c_i64), ("n", c_i64), ("k", c_i64), ("a", c_ptr), ("b", c_ptr), ("d", c_ptr), ("bias", c_ptr),
                ("sm_count", c_i32), ("device_id", c_i32), ("chunk_flags", c_ptr), ("epoch", c_ptr),
                ("rows_per_shard", c_i32), ("chunk_rows", c_i32), ("chunks_per_shard", c_i32), ("wait", c_i32),
                ("m_tile_order", c_ptr), ("swizzle", c_i32), ("pad_", c_i32), ("ctx", FsCtx)] + _TAIL


class FsGemmRsArgs(ctypes.Structure):
    _fields_ = [("m", c_i64), ("n", c_i64), ("k", c_i64), ("a", c_ptr), ("b", c_ptr), ("d", c_ptr), ("bias", c_ptr),
                ("sm_count", c_i32), ("device_id", c_i32), ("tile_ready", c_ptr), ("epoch", c_ptr),
                ("m_tile_order", c_ptr), ("swizzle", c_i32), ("pad_", c_i32), ("ctx", FsCtx)] + _TAIL


ABI_STRUCTS = {"FsCtx": FsCtx, "FsLaunch": FsLaunch, "FsAgGemmArgs": FsAgGemmArgs, "FsGemmRsArgs": FsGemmRsArgs}
ARGS_TYPE = {"ag_gemm": FsAgGemmArgs, "gemm_rs": FsGemmRsArgs}
GemmArgs = Union[FsAgGemmArgs, FsGemmRsArgs]

# Return codes of the `_params` functions (gemm_host.cuh, fs::gemm::host).
PARAMS_ERRORS = {1: "invalid argument", 2: "misaligned operand", 3: "parameter buffer too small",
                 4: "CUTLASS cannot implement", 5: "workspace needed", 6: "TMA descriptor"}

SWIZZLES = kconfig.SWIZZLES
ENV_PDL = "FLUX_SHMEM_GEMM_PDL"


def uses_pdl(args: "GemmArgs") -> bool:
    """Whether a launch of `args` gets programmatic dependent launch: only with FLUX_SHMEM_GEMM_PDL=1 (an
    experiment until measured) and only for plain GEMMs (no chunk waits, no counters): a fused GEMM's early start
    would hold SMs its comm kernel may need."""
    if os.environ.get(ENV_PDL, "") != "1":
        return False
    if isinstance(args, FsAgGemmArgs):
        return not args.wait
    return not args.tile_ready


def kernel_name(family: str, dtype_name: str, b_layout: str) -> str:
    if family not in FAMILIES:
        raise FluxShmemError(f"GEMM family {family!r} unknown: use one of {FAMILIES}")
    if dtype_name not in DTYPE_NAMES:
        raise FluxShmemError(f"GEMM dtype {dtype_name!r} unsupported: use one of {DTYPE_NAMES}")
    if b_layout not in B_LAYOUTS:
        raise FluxShmemError(f"b_layout {b_layout!r} unknown: 'kn' (B is [K, N]) or 'nk' (B is [N, K])")
    if dtype_name == "e4m3" and b_layout not in FP8_LAYOUTS:
        raise FluxShmemError(kconfig.FP8_LAYOUT_ERROR)
    return f"fs_{family}_{dtype_name}_{b_layout}"


def dtype_name(dtype) -> str:
    return kconfig.dtype_name(dtype)


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
    rejected first (those errors are raised without a driver). `config`: the registry entry the library was built
    for (checked against what the library reports; None: the entry that matches it)."""

    def __init__(self, lib: ctypes.CDLL, family: str, dtype_name_: str, b_layout: str, *,
                 config: "str | registry.KernelConfig | None" = None, cache_size: int = 64):
        self.lib, self.family = lib, family
        self.name = kernel_name(family, dtype_name_, b_layout)
        self.args_type = ARGS_TYPE[family]
        fp8_fn = getattr(lib, "fs_gemm_fp8", None)  # absent from libraries built before the fp8 build existed
        fp8 = bool(fp8_fn()) if fp8_fn is not None else False
        if fp8 != (dtype_name_ == "e4m3"):
            raise BuildError(f"host library of {family} is its {'fp8' if fp8 else '16-bit'} build, which has no "
                             f"{self.name}: load the {'16-bit' if fp8 else 'fp8'} build "
                             f"(kernels.build.build(..., fp8={not fp8}))")
        try:
            self._params = getattr(lib, self.name + "_params")
            size_fn = getattr(lib, self.name + "_params_size")
            self._workspace_size = getattr(lib, self.name + "_workspace_size")
            self._last_error = lib.fs_gemm_last_error
            for fn in ("fs_gemm_tile_m", "fs_gemm_tile_n", "fs_gemm_tile_k", "fs_gemm_cluster_m",
                       "fs_gemm_cluster_n", "fs_gemm_pingpong", "fs_gemm_fp8", "fs_gemm_fp8_fast_accum"):
                getattr(lib, fn).restype = c_i32
        except AttributeError as e:
            raise BuildError(f"host library of {family} lacks {e}: rebuild with `python -m flux_shmem.build "
                             f"--family {family} --force`") from e
        self._params.restype = ctypes.c_int
        self._params.argtypes = [ctypes.POINTER(self.args_type), c_ptr, ctypes.c_size_t, ctypes.POINTER(FsLaunch)]
        self._workspace_size.restype = c_i64
        self._workspace_size.argtypes = [ctypes.POINTER(self.args_type)]
        size_fn.restype = ctypes.c_size_t
        self._last_error.restype = ctypes.c_char_p
        self.params_size = int(size_fn())
        self.tile_shape = (int(lib.fs_gemm_tile_m()), int(lib.fs_gemm_tile_n()))
        self.cluster_shape = (int(lib.fs_gemm_cluster_m()), int(lib.fs_gemm_cluster_n()))
        self.pingpong = bool(lib.fs_gemm_pingpong())
        self.tile_k = int(lib.fs_gemm_tile_k())
        self.fp8 = bool(lib.fs_gemm_fp8())
        self.fast_accum = bool(lib.fs_gemm_fp8_fast_accum())
        built = (self.tile_shape, self.cluster_shape, self.pingpong)
        if config is None:
            match = [c for c in registry.CONFIGS.values() if _shape_of(c) == built]
            if not match:
                raise BuildError(f"host library of {family} reports tile {self.tile_shape}, cluster "
                                 f"{self.cluster_shape}, pingpong={self.pingpong}: no registry entry has that")
            config = match[0]
        self.config = registry.get(config)
        if _shape_of(self.config) != built:
            raise BuildError(f"host library of {family} was built as tile {self.tile_shape}, cluster "
                             f"{self.cluster_shape}, pingpong={self.pingpong}, not as {self.config.name} "
                             f"({self.config.describe()}): rebuild with `python -m flux_shmem.build --family {family} "
                             f"--config {self.config.name} --force`")
        self._cache: collections.OrderedDict[bytes, tuple[bytes, FsLaunch]] = collections.OrderedDict()
        self._cache_size = cache_size

    def _error(self, rc: int) -> FluxShmemError:
        msg = (self._last_error() or b"").decode(errors="replace")
        return FluxShmemError(f"{self.name} [{self.config.name}]: {PARAMS_ERRORS.get(rc, 'error')} (code {rc}): "
                              f"{msg}")

    def _check_type(self, args: GemmArgs) -> None:
        if not isinstance(args, self.args_type):
            raise FluxShmemError(f"{self.name} takes {self.args_type.__name__}, not {type(args).__name__}")

    def params(self, args: GemmArgs) -> tuple[bytes, FsLaunch]:
        """(parameter block, launch geometry) for `args`; cached per distinct args (all fields are the key, since
        the TMA descriptors embed the pointers)."""
        self._check_type(args)
        key = bytes(args)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        buf = ctypes.create_string_buffer(self.params_size)
        launch = FsLaunch()
        rc = self._params(ctypes.byref(args), buf, self.params_size, ctypes.byref(launch))
        if rc != 0:
            raise self._error(rc)
        out = (buf.raw, launch)
        self._cache[key] = out
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out

    def workspace_size(self, args: GemmArgs) -> int:
        """Bytes of zeroed workspace `args` needs (0 unless splits > 1 and some tile is split)."""
        self._check_type(args)
        n = int(self._workspace_size(ctypes.byref(args)))
        if n < 0:
            raise self._error(1)
        return n

    def tiles(self, m: int, n: int) -> tuple[int, int]:
        """(tiles_m, tiles_n) of an M x N output: the length of `m_tile_order`, and the tile_ready words the
        gemm_rs epilogue sets (tiles_m * tiles_n)."""
        tm, tn = self.tile_shape
        return (m + tm - 1) // tm, (n + tn - 1) // tn

    def swizzle(self, m: int, group_m_tiles: Optional[int] = None) -> int:
        """The swizzle for an output of m rows with groups of at most `group_m_tiles` of this kernel's M-tiles
        (config.swizzle_for; FLUX_SHMEM_GEMM_CONFIG's swizzle= overrides)."""
        forced = kconfig.forced().get("swizzle")
        if forced is not None:
            return forced
        rows = group_m_tiles * self.tile_shape[0] if group_m_tiles else None
        return kconfig.swizzle_for(self.config, m, rows)[0]


def _shape_of(cfg: registry.KernelConfig) -> tuple:
    return ((cfg.tile_m, cfg.tile_n), (cfg.cluster_m, cfg.cluster_n), cfg.pingpong)


class CutlassGemm:
    """One CUTLASS GEMM kernel of a loaded family and kernel configuration (needs a Hopper GPU): `launch(args)` runs
    it on a stream. `CutlassGemm.get(...)` shares one instance per (family, dtype, layout, configuration) in the
    process; an instance owns the split-K workspace its launches use, so launches of one instance on several
    streams at once need separate instances (or their own `args.workspace`)."""

    def __init__(self, family: str, dtype, b_layout: str, config: "str | registry.KernelConfig | None" = None):
        from . import module as kmodule
        self.family, self.dtype, self.b_layout = family, dtype, b_layout
        self.config = registry.get(config)
        dt = dtype_name(dtype)
        name = kernel_name(family, dt, b_layout)
        self.fp8 = dt == "e4m3"
        self.module = kmodule.load(family, self.config.name, fp8=self.fp8)
        fp8_flag = " --fp8" if self.fp8 else ""
        if self.module.host_lib is None:
            raise BuildError(f"family {family} was built without its host library: rebuild it with "
                             f"`python -m flux_shmem.build --family {family} --config {self.config.name}{fp8_flag} "
                             "--force`")
        check_abi(self.module.host_lib)
        self.host = GemmHost(self.module.host_lib, family, dtype_name(dtype), b_layout, config=self.config)
        self.kernel = self.module.kernel(name)
        if self.kernel.param_size is not None and self.kernel.param_size != self.host.params_size:
            raise BuildError(f"{name}: the cubin takes {self.kernel.param_size} parameter bytes, the host library "
                             f"makes {self.host.params_size}: cubin and host library come from different builds; "
                             f"rebuild with `python -m flux_shmem.build --family {family} --config "
                             f"{self.config.name}{fp8_flag} --force`")
        self.name = name
        self._workspace = None  # torch uint8 tensor, zeroed when allocated; the kernel leaves it zeroed
        self._max_ctas: dict[int, int] = {}  # CUstream handle -> resident CTAs in its context (0: unknown)

    @staticmethod
    def get(family: str, dtype, b_layout: str, config: "str | registry.KernelConfig | None" = None) -> "CutlassGemm":
        """The process's shared instance for this kernel (built and loaded on first use)."""
        return _shared_gemm(family, dtype_name(dtype), b_layout, registry.get(config).name)

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

    def workspace(self, nbytes: int):
        """This instance's zeroed split-K workspace of at least `nbytes` (grown by replacing it, outside CUDA-graph
        capture only)."""
        import torch
        if self._workspace is None or self._workspace.numel() < nbytes:
            if torch.cuda.is_current_stream_capturing():
                raise FluxShmemError(f"{self.name} [{self.config.name}]: this split-K launch needs a {nbytes}-byte "
                                     "workspace, which cannot be allocated during CUDA-graph capture: run the same "
                                     "call once before capturing (or pass args.workspace)")
            self._workspace = torch.zeros(max(nbytes, 1 << 20), dtype=torch.uint8, device="cuda")
        return self._workspace

    def with_workspace(self, args: GemmArgs):
        """(args, workspace tensor or None): `args` itself when the launch needs no workspace or brings its own,
        else a copy pointing at this instance's. Whoever keeps the parameter block must keep the tensor alive."""
        if args.splits <= 1 or args.workspace:
            return args, None
        need = self.host.workspace_size(args)
        if need == 0:
            return args, None
        ws = self.workspace(need)
        out = type(args).from_buffer_copy(args)
        out.workspace, out.workspace_bytes = ws.data_ptr(), ws.numel()
        return out, ws

    def max_ctas(self, geo: FsLaunch, stream=None) -> Optional[int]:
        """CTAs of this kernel that can be resident at once in the context of `stream` (default torch's current;
        the driver's occupancy answer for its cluster shape, cached per stream), or None where the driver cannot
        say."""
        import torch
        handle = int((stream or torch.cuda.current_stream()).cuda_stream)
        n_ctas = self._max_ctas.get(handle)
        if n_ctas is None:
            cl = tuple(geo.cluster)
            n = self.kernel.max_active_clusters(tuple(geo.block), int(geo.smem_bytes), cl, stream=handle)
            n_ctas = self._max_ctas[handle] = (n * cl[0] * cl[1] * cl[2]) if n else 0
        return n_ctas or None

    def launch(self, args: GemmArgs, stream=None, started=None) -> FsLaunch:
        """Fill (or reuse) the parameter block for `args` and launch on `stream` (default: torch's current). A
        persistent grid larger than what can be resident at once (occupancy query) is shrunk to fit: its CTAs
        would otherwise wait for each other's SMs."""
        given = args
        args, _ws = self.with_workspace(given)  # the instance holds the current workspace
        blob, geo = self.host.params(args)
        cap = self.max_ctas(geo, stream)
        if cap is not None and geo.grid[0] * geo.grid[1] * geo.grid[2] > cap and args.sm_count > cap:
            args = type(given).from_buffer_copy(given)
            args.sm_count = cap  # fewer CTAs split other tiles: the workspace is sized again
            args, _ws = self.with_workspace(args)
            blob, geo = self.host.params(args)
        self.kernel.launch(blob, tuple(geo.grid), tuple(geo.block), smem=int(geo.smem_bytes), stream=stream,
                           cluster=tuple(geo.cluster), started=started, pdl=uses_pdl(args))
        return geo

    def prepare(self, args: GemmArgs):
        """A callable `run(stream=None)` that launches `args` with the parameter block made now (benchmarks and
        CUDA graphs: no per-launch host work but the launch itself). It keeps its workspace alive."""
        args, ws = self.with_workspace(args)
        blob, geo = self.host.params(args)
        grid, block, cluster, smem = tuple(geo.grid), tuple(geo.block), tuple(geo.cluster), int(geo.smem_bytes)
        kernel, pdl = self.kernel, uses_pdl(args)

        def run(stream=None, _keep=ws) -> None:
            kernel.launch(blob, grid, block, smem=smem, stream=stream, cluster=cluster, pdl=pdl)
        run.geometry = geo  # type: ignore[attr-defined]
        return run


@functools.lru_cache(maxsize=None)
def _shared_gemm(family: str, dt: str, b_layout: str, config: str) -> CutlassGemm:
    return CutlassGemm(family, dt, b_layout, config)


def plain_args(family: str, a, b, d, bias, m: int, n: int, k: int, *, sm_count: int, device_id: int,
               choice: kconfig.Choice, scale_a: int = 0, scale_b: int = 0, scale_kind: int = 0) -> GemmArgs:
    """Argument struct of a plain GEMM (no waits, no signals) of either family with `choice`'s swizzle and split;
    scale_a/scale_b (device addresses of fp32 scales) and scale_kind for the e4m3 kernels."""
    common = dict(m=m, n=n, k=k, a=a, b=b, d=d, bias=bias or 0, sm_count=sm_count, device_id=device_id,
                  swizzle=choice.swizzle, splits=choice.split, tail_chunks=choice.chunks, ctx=FsCtx(),
                  scale_a=scale_a or 0, scale_b=scale_b or 0, scale_kind=scale_kind)
    return ARGS_TYPE[family](**common)


def fp8_scales(a, b, scale_a, scale_b, *, out_dtype=None, bias=None):
    """Check fp8 operands of `gemm` and normalise their scales: (scale_a, scale_b, scale_kind) with each scale a
    flat fp32 view (one element: per-tensor). a: [M, K] e4m3; b: [K, N] e4m3, the transpose of a row-major
    [N, K] tensor; scale_a: shape [] or [1] (per-tensor) or [M] / [M, 1] (rowwise, one per row of a); scale_b:
    [] or [1], or [N] / [1, N] (one per column of b); both fp32 on a's device, as torch._scaled_mm takes them.
    Raises FluxShmemError naming the fix. Needs no GPU (the checks read shapes, dtypes and devices only)."""
    import torch
    for name, t in (("a", a), ("b", b)):
        if t.dtype == torch.float8_e5m2:
            raise FluxShmemError(f"gemm: {name} is float8_e5m2; the fp8 kernels take float8_e4m3fn: cast to "
                                 f"float8_e4m3fn ({name}.to(torch.float8_e4m3fn), rescaled for its range)")
        if t.dtype != torch.float8_e4m3fn:
            raise FluxShmemError(f"gemm: a and b must both be float8_e4m3fn for an fp8 GEMM; {name} is {t.dtype} "
                                 f"(cast it with {name}.to(torch.float8_e4m3fn) and a scale)")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise FluxShmemError(f"gemm: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply")
    m, n = a.shape[0], b.shape[1]
    if b.is_contiguous() and not b.t().is_contiguous():
        raise FluxShmemError(f"gemm: {kconfig.FP8_LAYOUT_ERROR}")
    if scale_a is None or scale_b is None:
        raise FluxShmemError("gemm: fp8 GEMMs need scale_a and scale_b (fp32 tensors, D = scale_a * scale_b * "
                             "(a @ b)): pass torch.ones((), dtype=torch.float32, device=a.device) for an unscaled "
                             "operand")
    want = torch.bfloat16 if out_dtype is None else out_dtype
    if want != torch.bfloat16:
        raise FluxShmemError(f"gemm: fp8 GEMMs output torch.bfloat16 (the kernels built); got out_dtype={want}: "
                             "pass out_dtype=torch.bfloat16 and cast the result")
    if bias is not None and (bias.dtype != want or tuple(bias.shape) != (n,)):
        raise FluxShmemError(f"gemm: bias must be [{n}] of the output dtype {want}; got {tuple(bias.shape)} "
                             f"{bias.dtype} (bias.to({want}))")
    out = []
    kind = 0
    for name, s, rows, vec_shapes, bit in (("scale_a", scale_a, m, ((m,), (m, 1)), SCALE_ROWWISE_A),
                                           ("scale_b", scale_b, n, ((n,), (1, n)), SCALE_ROWWISE_B)):
        if not isinstance(s, torch.Tensor):
            raise FluxShmemError(f"gemm: {name} must be a torch.Tensor of fp32 (a Python number cannot be "
                                 f"captured in a CUDA graph): pass torch.tensor({s!r}, dtype=torch.float32, "
                                 "device=a.device)")
        if s.dtype != torch.float32:
            raise FluxShmemError(f"gemm: {name} must be float32, got {s.dtype}: pass {name}.float()")
        if s.device != a.device:
            raise FluxShmemError(f"gemm: {name} is on {s.device} but a is on {a.device}: pass "
                                 f"{name}.to({str(a.device)!r})")
        shape = tuple(s.shape)
        if shape in ((), (1,), (1, 1)):
            pass
        elif shape in vec_shapes:
            kind |= bit
        else:
            per = "row of a" if name == "scale_a" else "column of b"
            raise FluxShmemError(f"gemm: {name} has shape {shape}; use [] or [1] (per-tensor) or "
                                 f"{' or '.join(str(list(v)) for v in vec_shapes)} (rowwise: one per {per})")
        if not s.is_contiguous():  # a copy here would be freed before the kernel reads it
            raise FluxShmemError(f"gemm: {name} must be contiguous: pass {name}.contiguous()")
        out.append(s.reshape(-1))  # a view: the caller's tensor holds the memory the kernel reads
    return out[0], out[1], kind
