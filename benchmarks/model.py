"""A small analytical model of the fused ops' run time.

Inputs: the measured GEMM speed (TFLOP/s, from ``gemm_only``), link bandwidths
(NVLink and InfiniBand, GB/s per direction per GPU / per NIC), the world size,
GPUs per node, and a fixed per-op latency.

Communication (AllGather+GEMM; GEMM+ReduceScatter is its mirror image)
----------------------------------------------------------------------
Every rank owns one *shard* (AG: its ``[m/world, k]`` rows of A; RS: the
``[m/world, n]`` output rows it ends up with).  With ``L`` GPUs per node and
``nodes = world / L``, the two-level scheme is: each GPU receives the
``nodes-1`` shards of its counterparts (same local rank) on the other nodes
over IB, then the GPUs of a node exchange their own and their IB-received
shards over NVLink.  Bytes per GPU::

    ib_bytes     = (nodes - 1) * shard
    nvlink_bytes = (L - 1) * nodes * shard
    t_comm       = nvlink_bytes / nvlink_bw + ib_bytes / ib_bw

(on one node: ``ib_bytes == 0`` and ``nvlink_bytes == (world-1) * shard``).
For RS the same amounts are sent instead of received (partial sums).

Overlap
-------
The GEMM is split into ``world`` equal chunks of ``c = t_gemm / world`` (one
per shard).  AG+GEMM computes the local shard first, then chunk ``j`` as soon
as it has arrived; arrivals are at or before a uniform schedule ``j * t_comm /
(world-1)``.  The finish time of that pipeline is ``max_j(arrival_j + (world -
j) * c)``, which is linear in ``j`` and so is reached at an end point::

    t_fused = max(t_gemm, t_comm + t_gemm / world) + latency

i.e. ``max(t_gemm, t_comm)`` plus an exposed part: zero when the local shard's
GEMM covers the first chunk's transfer and the GEMM stays ahead (compute
bound); at most one chunk's GEMM (``t_gemm/world``) when communication bound,
because the last chunk to arrive still has to be multiplied.  GEMM+RS is the
same pipeline reversed in time (the last tile's transfer/reduce is exposed),
so it has the same formula.  The standalone collectives are ``t_comm +
latency``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Tuple

__all__ = [
    "NVLINK_NOMINAL_GBPS",
    "IB_NOMINAL_GBPS",
    "Hardware",
    "Prediction",
    "topology",
    "comm_bytes_per_gpu",
    "comm_time_ms",
    "fused_time_ms",
    "shard_bytes",
    "predict",
]

NVLINK_NOMINAL_GBPS = 450.0  # H100/H200 NVLink 4: 900 GB/s bidirectional per GPU
IB_NOMINAL_GBPS = 50.0  # 400 Gb/s NDR NIC, one per GPU

FUSED_OPS = ("ag_gemm", "gemm_rs")
COMM_OPS = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Hardware:
    """Achievable bandwidths (GB/s, one direction) and the fixed per-op latency."""

    nvlink_gbps: float = 360.0  # achievable, ~80% of the 450 nominal
    ib_gbps: float = 40.0  # achievable, ~80% of the 50 nominal
    gpus_per_node: int = 8
    latency_us: float = 10.0

    def __post_init__(self) -> None:
        for name in ("nvlink_gbps", "ib_gbps"):
            v = getattr(self, name)
            if not v > 0:  # math.inf is allowed (an ideal link)
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")


@dataclass(frozen=True)
class Prediction:
    op: str
    t_gemm_ms: float
    t_comm_ms: float
    exposed_ms: float
    latency_ms: float
    total_ms: float
    nvlink_bytes: int
    ib_bytes: int
    nodes: int
    gpus_per_node: int

    def as_dict(self) -> dict:
        return asdict(self)


def topology(world: int, gpus_per_node: int) -> Tuple[int, int]:
    """(nodes, GPUs per node actually used) for ``world`` ranks."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    local = min(gpus_per_node, world)
    if world % local:
        raise ValueError(f"world {world} is not a whole number of nodes of {local} GPUs")
    return world // local, local


def comm_bytes_per_gpu(shard: int, world: int, gpus_per_node: int) -> Tuple[int, int]:
    """(NVLink bytes, IB bytes) each GPU receives (AG) / sends (RS), two-level scheme."""
    if shard < 0:
        raise ValueError(f"shard bytes must be >= 0, got {shard}")
    nodes, local = topology(world, gpus_per_node)
    nvlink = (local - 1) * nodes * shard
    ib = (nodes - 1) * shard
    return nvlink, ib


def comm_time_ms(shard: int, world: int, hw: Hardware) -> float:
    nvlink, ib = comm_bytes_per_gpu(shard, world, hw.gpus_per_node)
    t = 0.0
    if nvlink:
        t += nvlink / (hw.nvlink_gbps * 1e9)
    if ib:
        t += ib / (hw.ib_gbps * 1e9)
    return t * 1e3


def fused_time_ms(t_gemm_ms: float, t_comm_ms: float, world: int, latency_ms: float = 0.0) -> Tuple[float, float]:
    """(total, exposed) for the chunk pipeline described in the module docstring."""
    if t_gemm_ms < 0 or t_comm_ms < 0 or latency_ms < 0:
        raise ValueError("times must be >= 0")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if world == 1 or t_comm_ms == 0.0:
        body = t_gemm_ms
    else:
        body = max(t_gemm_ms, t_comm_ms + t_gemm_ms / world)
    exposed = body - max(t_gemm_ms, t_comm_ms)
    return body + latency_ms, exposed


def shard_bytes(op: str, m: int, n: int, k: int, world: int, elem_bytes: int) -> int:
    """Bytes of one rank's shard: AG rows of A ``[m/world, k]``, RS output rows ``[m/world, n]``.

    For the standalone collectives pass the same (m, n, k) as the fused op they
    belong to: all_gather moves A (``[m, k]``), reduce_scatter moves C (``[m, n]``).
    """
    if op in ("ag_gemm", "all_gather"):
        return (m // world) * k * elem_bytes
    if op in ("gemm_rs", "reduce_scatter"):
        return (m // world) * n * elem_bytes
    raise ValueError(f"unknown op {op!r}")


def predict(
    op: str,
    m: int,
    n: int,
    k: int,
    world: int,
    elem_bytes: int,
    hw: Hardware,
    gemm_tflops: Optional[float] = None,
) -> Prediction:
    """Predicted time of one op.

    ``m, n, k`` are the *global* problem (as in ``shapes.Problem``): for
    ag_gemm ``n`` is split over ranks, for gemm_rs ``k`` is.  ``gemm_tflops``
    (measured GEMM speed) is required for the fused ops.
    """
    nodes, local = topology(world, hw.gpus_per_node)
    shard = shard_bytes(op, m, n, k, world, elem_bytes)
    nvlink, ib = comm_bytes_per_gpu(shard, world, hw.gpus_per_node)
    t_comm = comm_time_ms(shard, world, hw)
    latency = hw.latency_us * 1e-3
    if op in FUSED_OPS:
        if gemm_tflops is None or not gemm_tflops > 0:
            raise ValueError(f"{op} needs a positive measured gemm_tflops, got {gemm_tflops!r}")
        n_loc = n // world if op == "ag_gemm" else n
        k_loc = k // world if op == "gemm_rs" else k
        t_gemm = 2.0 * m * n_loc * k_loc / (gemm_tflops * 1e12) * 1e3
        total, exposed = fused_time_ms(t_gemm, t_comm, world, latency)
    elif op in COMM_OPS:
        t_gemm = 0.0
        exposed = 0.0
        total = t_comm + latency
    else:
        raise ValueError(f"unknown op {op!r}")
    return Prediction(
        op=op,
        t_gemm_ms=t_gemm,
        t_comm_ms=t_comm,
        exposed_ms=exposed,
        latency_ms=latency,
        total_ms=total,
        nvlink_bytes=nvlink,
        ib_bytes=ib,
        nodes=nodes,
        gpus_per_node=local,
    )
