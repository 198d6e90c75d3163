"""Shape sets, per-world sharding and validation (pure, no torch).

A problem is given by its *global* GEMM sizes ``M x N x K`` (tensor parallel
over ``world`` ranks):

* ``ag_gemm`` (QKV / up projection): A ``[M, K]`` is row-sharded, each rank
  holds ``[M/world, K]``; B is column-sharded, each rank holds ``[K, N/world]``;
  each rank computes ``[M, N/world]`` = all_gather(A) @ B_local.
* ``gemm_rs`` (down projection): A is column-sharded ``[M, K/world]`` and B
  row-sharded ``[K/world, N]``; each rank ends with ``[M/world, N]`` =
  reduce_scatter(A_local @ B_local).
* ``all_gather``: the communication of ag_gemm alone, ``[M/world, K]`` -> ``[M, K]``.
* ``reduce_scatter``: the communication of gemm_rs alone, ``[M, N]`` -> ``[M/world, N]``.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "OPS",
    "FUSED_OPS",
    "COMM_OPS",
    "DTYPE_BYTES",
    "Layer",
    "LAYERS",
    "DEFAULT_MS",
    "QUICK_MS",
    "Problem",
    "parse_shapes",
    "parse_ops",
    "quick_layers",
    "custom_layers",
    "validate",
    "build_problems",
    "rotation_sets",
    "round_up",
    "Model",
    "MODELS",
    "ShardShape",
    "SUITES",
    "SuiteName",
    "tp_shard_suite",
    "tp_shard_quick",
    "tp_shard_small",
    "suite",
]

FUSED_OPS = ("ag_gemm", "gemm_rs")
COMM_OPS = ("all_gather", "reduce_scatter")
OPS = FUSED_OPS + COMM_OPS
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}  # operands; fp8 (e4m3) GEMMs output bf16


@dataclass(frozen=True)
class Layer:
    """One transformer layer's two tensor-parallel GEMMs (global sizes).

    ``ag_n, ag_k``: N (split over ranks) and K of the AG+GEMM projection.
    ``rs_n, rs_k``: N and K (split over ranks) of the GEMM+RS projection.
    """

    name: str
    ag_n: int
    ag_k: int
    rs_n: int
    rs_k: int


LAYERS = {
    # Llama-3 70B: hidden 8192, ffn 28672.  up/gate-style AG+GEMM and down-projection GEMM+RS.
    "llama3-70b": Layer("llama3-70b", ag_n=28672, ag_k=8192, rs_n=8192, rs_k=28672),
    # GPT-3 175B: hidden 12288, ffn 4*12288.
    "gpt3-175b": Layer("gpt3-175b", ag_n=49152, ag_k=12288, rs_n=12288, rs_k=49152),
}
DEFAULT_MS = (4096, 8192, 16384)
QUICK_MS = (4096, 8192)
QUICK_LOCAL = 4096  # per-GPU N (AG) and K (RS) of the --quick shapes


def round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


def quick_layers(world: int) -> List[Layer]:
    """The --quick layer: per-GPU GEMM is M x 4096 x 4096 whatever the world."""
    d = QUICK_LOCAL
    return [Layer("quick", ag_n=d * world, ag_k=d, rs_n=d, rs_k=d * world)]


def custom_layers(shapes: Sequence[Tuple[int, int, int]]) -> List[Tuple[int, Layer]]:
    """--shapes MxNxK: the same global M, N, K for every op."""
    return [(m, Layer("custom", ag_n=n, ag_k=k, rs_n=n, rs_k=k)) for m, n, k in shapes]


_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


def parse_shapes(text: str):
    """Parse ``"MxNxK,MxNxK,..."`` into a list of (M, N, K), or a suite name (``tp-shard``, ``tp-shard-quick``) into
    a SuiteName; ValueError on bad input."""
    if text is None or not str(text).strip():
        raise ValueError("--shapes needs at least one MxNxK, e.g. 8192x28672x8192, or a suite name: "
                         + ", ".join(SUITES))
    if str(text).strip() in SUITES:
        return SuiteName(str(text).strip())
    out = []
    for part in str(text).split(","):
        if not part.strip():
            raise ValueError(f"empty entry in --shapes {text!r}")
        mt = _SHAPE_RE.match(part)
        if not mt:
            raise ValueError(f"bad shape {part.strip()!r}: expected MxNxK with positive integers, e.g. 8192x28672x8192")
        m, n, k = (int(g) for g in mt.groups())
        if min(m, n, k) <= 0:
            raise ValueError(f"bad shape {part.strip()!r}: M, N and K must be positive")
        out.append((m, n, k))
    return out


def parse_ops(text: str) -> List[str]:
    ops = [o.strip() for o in str(text).split(",") if o.strip()]
    if not ops:
        raise ValueError(f"--ops needs at least one of {','.join(OPS)}")
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"unknown op(s) {','.join(bad)}; choose from {','.join(OPS)}")
    seen = []
    for o in ops:
        if o not in seen:
            seen.append(o)
    return seen


@dataclass(frozen=True)
class Problem:
    """One benchmark configuration: an op on global sizes M x N x K over ``world`` ranks."""

    op: str
    label: str
    m: int
    n: int
    k: int
    world: int
    dtype: str = "bf16"

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def comm_elem_bytes(self) -> int:
        """Bytes per element of what the collective moves: operands for AG, the (16-bit) outputs for RS."""
        if self.dtype == "fp8" and self.op in ("gemm_rs", "reduce_scatter"):
            return 2
        return self.elem_bytes

    @property
    def m_local(self) -> int:
        return self.m // self.world

    @property
    def n_local(self) -> int:
        return self.n // self.world if self.op == "ag_gemm" else self.n

    @property
    def k_local(self) -> int:
        return self.k // self.world if self.op == "gemm_rs" else self.k

    @property
    def is_fused(self) -> bool:
        return self.op in FUSED_OPS

    @property
    def flops(self) -> int:
        """GEMM FLOPs per GPU (0 for the standalone collectives)."""
        if not self.is_fused:
            return 0
        return 2 * self.m * self.n_local * self.k_local

    @property
    def comm_shape(self) -> Tuple[int, int]:
        """(rows, cols) of the full tensor the collective moves: A [M, K] for AG, C [M, N] for RS."""
        if self.op in ("ag_gemm", "all_gather"):
            return self.m, self.k
        return self.m, self.n

    @property
    def comm_bytes(self) -> int:
        rows, cols = self.comm_shape
        return rows * cols * self.comm_elem_bytes

    @property
    def shape_str(self) -> str:
        if self.is_fused:
            return f"{self.m}x{self.n}x{self.k}"
        rows, cols = self.comm_shape
        return f"{rows}x{cols}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            m_local=self.m_local,
            n_local=self.n_local,
            k_local=self.k_local,
            flops_per_gpu=self.flops,
            comm_rows=self.comm_shape[0],
            comm_cols=self.comm_shape[1],
            comm_bytes=self.comm_bytes,
            shape=self.shape_str,
        )
        return d


def problem_for(op: str, m: int, layer: Layer, world: int, dtype: str = "bf16") -> Problem:
    if op in ("ag_gemm", "all_gather"):
        n, k = layer.ag_n, layer.ag_k
    elif op in ("gemm_rs", "reduce_scatter"):
        n, k = layer.rs_n, layer.rs_k
    else:
        raise ValueError(f"unknown op {op!r}")
    return Problem(op=op, label=layer.name, m=m, n=n, k=k, world=world, dtype=dtype)


def validate(p: Problem) -> Optional[str]:
    """None if ``p`` can run on ``p.world`` ranks, else the reason it cannot."""
    if p.op not in OPS:
        return f"unknown op {p.op!r}"
    if p.dtype not in DTYPE_BYTES:
        return f"unknown dtype {p.dtype!r}"
    if p.dtype == "fp8" and p.op != "gemm_rs":
        return f"fp8 is measured for gemm_rs only (the AG+GEMM benchmark makes no fp8 inputs yet), not {p.op}"
    if p.world < 1:
        return f"world must be >= 1, got {p.world}"
    if min(p.m, p.n, p.k) <= 0:
        return f"M, N, K must be positive, got {p.m}x{p.n}x{p.k}"
    if p.m % p.world:
        return f"M={p.m} is not divisible by world={p.world}"
    if p.op == "ag_gemm" and p.n % p.world:
        return f"N={p.n} (split over ranks for ag_gemm) is not divisible by world={p.world}"
    if p.op == "gemm_rs" and p.k % p.world:
        return f"K={p.k} (split over ranks for gemm_rs) is not divisible by world={p.world}"
    return None


def build_problems(
    ops: Sequence[str],
    world: int,
    *,
    dtype: str = "bf16",
    shapes: Optional[Sequence[Tuple[int, int, int]]] = None,
    quick: bool = False,
    ms: Optional[Iterable[int]] = None,
) -> List[Tuple[Problem, Optional[str]]]:
    """All (problem, reason-it-cannot-run-or-None) pairs of a sweep, in run order.

    Order: by layer, then M, then op (so a fused op and its collective share
    cached inputs / measurements).
    """
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}")
    pairs: List[Tuple[int, Layer]] = []
    if isinstance(shapes, SuiteName):
        return _suite_problems(shapes, ops, world, dtype)
    if shapes:
        pairs = custom_layers(shapes)
    else:
        layers = quick_layers(world) if quick else list(LAYERS.values())
        m_values = list(ms) if ms else list(QUICK_MS if quick else DEFAULT_MS)
        if quick:
            m_values = [round_up(m, world) for m in m_values]
        pairs = [(m, layer) for layer in layers for m in m_values]
    out = []
    for m, layer in pairs:
        for op in ops:
            p = problem_for(op, m, layer, world, dtype)
            out.append((p, validate(p)))
    return out


def rotation_sets(
    bytes_per_set: int,
    l2_bytes: int,
    budget_bytes: Optional[int] = None,
    *,
    l2_multiple: float = 4.0,
    min_sets: int = 2,
    max_sets: int = 8,
) -> int:
    """How many input sets to rotate through so consecutive iterations do not hit in L2.

    Enough sets that the rotated footprint is ``l2_multiple`` times the L2
    size, clamped to [min_sets, max_sets] and to ``budget_bytes`` (never < 1).
    """
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    want = math.ceil(l2_multiple * max(l2_bytes, 0) / bytes_per_set)
    n = max(min_sets, min(max_sets, want))
    if budget_bytes is not None:
        n = min(n, max(1, int(budget_bytes // bytes_per_set)))
    return max(1, n)


# --- tp-shard: the per-GPU GEMMs that tensor parallelism runs (issue 11) ---------------------------------------------


@dataclass(frozen=True)
class Model:
    """The dense-layer sizes of one transformer: hidden size, attention heads and KV heads (head_dim each), FFN
    size, and whether the FFN is gated (gate and up projections, fused as gate+up or run apart)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool = True

    def layers(self) -> List[Tuple[str, str, int, int]]:
        """(layer, parallelism, N, K) of the full (unsharded) GEMMs; 'column': N is split over TP ranks (the
        AllGather+GEMM side), 'row': K is (the GEMM+ReduceScatter side)."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        out = [("qkv", "column", qkv, self.hidden), ("o_proj", "row", self.hidden, self.heads * self.head_dim),
               ("up", "column", self.ffn, self.hidden)]
        if self.gated:
            out.append(("gate_up", "column", 2 * self.ffn, self.hidden))
        out.append(("down", "row", self.hidden, self.ffn))
        return out


MODELS = {m.name: m for m in (
    Model("llama3-8b", 4096, 32, 8, 128, 14336),
    Model("llama3-70b", 8192, 64, 8, 128, 28672),
    Model("llama3-405b", 16384, 128, 8, 128, 53248),
    Model("gpt3-175b", 12288, 96, 96, 128, 49152, gated=False),
    Model("qwen2.5-72b", 8192, 64, 8, 128, 29568),
    Model("mixtral-8x7b", 4096, 32, 8, 128, 14336),  # attention and one expert's FFN: the same as llama3-8b's
)}
TP_SIZES = (2, 4, 8)
TP_SHARD_MS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class ShardShape:
    """One per-GPU GEMM M x N x K and where it comes from (model/layer/tp, every origin after deduplication).
    `parallel`: 'column' (M x N/TP x K, AllGather+GEMM) or 'row' (M x N x K/TP, GEMM+ReduceScatter) of the first
    origin; the same shape may be both."""

    m: int
    n: int
    k: int
    origins: Tuple[str, ...]
    parallel: Tuple[str, ...]

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"

    def global_for(self, op: str, tp: int) -> Tuple[int, int, int]:
        """The global (unsharded) M, N, K whose shard on `tp` ranks is this shape for `op` (run.py's convention)."""
        if op in ("ag_gemm", "all_gather"):
            return self.m, self.n * tp, self.k
        return self.m, self.n, self.k * tp


def _shard_entries(ms: Sequence[int] = TP_SHARD_MS, tps: Sequence[int] = TP_SIZES):
    for model in MODELS.values():
        for layer, par, n, k in model.layers():
            for tp in tps:
                if par == "column" and n % tp == 0:
                    ln, lk = n // tp, k
                elif par == "row" and k % tp == 0:
                    ln, lk = n, k // tp
                else:
                    continue
                if ln % 8 or lk % 8:  # TMA needs 16-byte rows (bf16/fp16)
                    continue
                for m in ms:
                    yield m, ln, lk, f"{model.name}/{layer}/tp{tp}", par, tp


def tp_shard_suite(ms: Sequence[int] = TP_SHARD_MS, tps: Sequence[int] = TP_SIZES) -> List[ShardShape]:
    """Every per-GPU GEMM of the models' QKV, o_proj, up, gate+up and down layers at TP 2, 4, 8 and the M values,
    deduplicated by (M, N, K), sorted by work then shape."""
    seen: dict = {}
    for m, n, k, origin, par, _tp in _shard_entries(ms, tps):
        origins, pars = seen.setdefault((m, n, k), ([], []))
        origins.append(origin)
        if par not in pars:
            pars.append(par)
    out = [ShardShape(m, n, k, tuple(o), tuple(p)) for (m, n, k), (o, p) in seen.items()]
    return sorted(out, key=lambda s: (s.m * s.n * s.k, s.m, s.n, s.k))


# Spans the regimes of tile counts and waves on ~132 SMs (under one wave, 1-3 waves, many), short and long K, and
# the shapes the issue measured. Every entry is in the full suite (tests check it).
TP_SHARD_QUICK = (
    "1024x1280x8192", "2048x1280x8192", "4096x1280x8192", "8192x1280x8192", "16384x1280x8192",
    "4096x3584x8192", "8192x3584x8192", "16384x3584x8192", "8192x7168x8192", "16384x7168x8192",
    "1024x4096x512", "2048x3072x4096", "8192x4096x1792", "8192x8192x1024", "16384x8192x3584", "4096x8192x7168",
    "8192x2304x16384", "8192x16384x2048", "4096x12288x6144", "8192x3696x8192", "8192x12288x1536",
)


def tp_shard_quick() -> List[ShardShape]:
    """A representative subset of the tp-shard suite (TP_SHARD_QUICK) for short device sessions."""
    full = {s.shape: s for s in tp_shard_suite()}
    missing = [t for t in TP_SHARD_QUICK if t not in full]
    if missing:
        raise ValueError(f"tp-shard-quick shapes not in the tp-shard suite: {missing}")
    return [full[t] for t in TP_SHARD_QUICK]


# Small M (decode, short prefill chunks) over the suite's every N x K: where a fused op's fixed costs and our GEMM's
# small-M kernels decide against cuBLAS (issue 36).
TP_SHARD_SMALL_MS = (64, 128, 256, 512)


def tp_shard_small() -> List[ShardShape]:
    """The tp-shard suite's N x K pairs at M = TP_SHARD_SMALL_MS."""
    return tp_shard_suite(ms=TP_SHARD_SMALL_MS)


SUITES = {"tp-shard": tp_shard_suite, "tp-shard-quick": tp_shard_quick, "tp-shard-small": tp_shard_small}


class SuiteName(str):
    """--shapes given as a suite name: build_problems takes the suite's per-GPU shapes."""


def suite(name: str) -> List[ShardShape]:
    if name not in SUITES:
        raise ValueError(f"unknown shape suite {name!r}: one of {', '.join(SUITES)}")
    return SUITES[name]()


def _suite_problems(name: str, ops: Sequence[str], world: int, dtype: str) -> List[Tuple[Problem, Optional[str]]]:
    """run.py --shapes tp-shard: every suite shape whose parallelism matches the op (column: ag_gemm/all_gather, row:
    gemm_rs/reduce_scatter), as the global problem whose per-GPU GEMM on `world` ranks is that shape."""
    out = []
    for s in suite(name):
        for op in ops:
            par = "column" if op in ("ag_gemm", "all_gather") else "row"
            if par not in s.parallel:
                continue
            m, n, k = s.global_for(op, world)
            p = Problem(op=op, label=f"{name}:{s.origins[0]}", m=m, n=n, k=k, world=world, dtype=dtype)
            out.append((p, validate(p)))
    return out
