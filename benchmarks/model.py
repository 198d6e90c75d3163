"""What the benchmarks predict: the fused ops through the tile-level simulator (flux_shmem.plan.simulate, which runs
the ops' own schedules and makes the same engine / SM-split choices they do), the standalone collectives by bytes
over bandwidth.

Inputs: the measured GEMM speed (TFLOP/s of ``gemm_only`` on the whole SM budget), link bandwidths (NVLink and
InfiniBand, GB/s per direction per GPU / per NIC; or the emulated link of ``FLUX_SHMEM_LINK_GBPS``), the world
size, GPUs per node, the SMs the process may use and a fixed per-op latency.

Communication bytes (two-level: every GPU receives the ``nodes-1`` shards of its counterparts on the other nodes
over IB, then the GPUs of a node exchange their own and those over NVLink)::

    ib_bytes     = (nodes - 1) * shard
    nvlink_bytes = (L - 1) * nodes * shard
    t_comm       = nvlink_bytes / nvlink_bw + ib_bytes / ib_bw

The fused time is the simulator's: chunk arrivals, the persistent GEMM's tile waves on the SMs the split leaves
it, and what is left exposed at the start and end of the pipeline.
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
    sms: int = 132  # SMs the process may use (the MPS share on a shared GPU)
    emulated: bool = False  # links paced by FLUX_SHMEM_LINK_GBPS on one GPU (copies otherwise at memory speed)
    link_latency_us: float = 1.5  # per transfer (FLUX_SHMEM_LINK_LATENCY_US when emulated)

    def __post_init__(self) -> None:
        for name in ("nvlink_gbps", "ib_gbps"):
            v = getattr(self, name)
            if not v > 0:  # math.inf is allowed (an ideal link)
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")
        if self.sms < 2:
            raise ValueError(f"sms must be >= 2, got {self.sms}")

    def links(self):
        """The simulator's link model for this hardware."""
        from flux_shmem.plan import costs
        if self.emulated:
            return costs.emulated_links(self.nvlink_gbps, self.link_latency_us, self.ib_gbps)
        return costs.Links(nvlink_gbps=self.nvlink_gbps, ib_gbps=self.ib_gbps,
                              nvlink_latency_us=self.link_latency_us)


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


def simulate_fused(op: str, m: int, n_loc: int, k_loc: int, world: int, gpus_per_node: int, elem_bytes: int,
                   hw: Hardware, gemm_tflops: float):
    """The simulator's result for one fused op on per-GPU sizes, with the op's own choices (engine, SM split)."""
    from flux_shmem.plan import costs, search
    from flux_shmem.plan import schedules as sch
    gemm = costs.Gemm.from_rate(k_loc, gemm_tflops / hw.sms)
    links = hw.links()
    if op == "ag_gemm":
        engines = search.ag_engines(gpus_per_node == world, hw.emulated, world)
        _, r = search.plan_ag_gemm(world=world, node_size=gpus_per_node, m=m, n=n_loc, k=k_loc,
                                     elem_bytes=elem_bytes, gemm=gemm, budget_sms=hw.sms,
                                     chunk_rows=sch.fused_chunk_rows(m // world, k_loc * elem_bytes, gemm.tile_m),
                                     links=links, engines=engines, pes=[0])
    else:
        _, r = search.plan_gemm_rs(world=world, node_size=gpus_per_node, m=m, n=n_loc, k=k_loc,
                                     elem_bytes=elem_bytes, gemm=gemm, budget_sms=hw.sms,
                                     unit_rows=sch.default_unit_rows(n_loc, elem_bytes, gemm.tile_m), links=links)
    return r


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
        if world == 1 or t_comm == 0.0:
            total, exposed = t_gemm + latency, 0.0
        else:
            res = simulate_fused(op, m, n_loc, k_loc, world, local, elem_bytes, hw, gemm_tflops)
            total = res.fused_us * 1e-3 + latency
            exposed = total - latency - max(t_gemm, t_comm)
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
