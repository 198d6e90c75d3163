"""What the planners' model of the machine charges: one GPU's links and copy rates (`Links`, `emulated_links` for
paced links), and the persistent GEMM's tile time (`Gemm`) with the re-reads of narrow swizzle groups
(`swizzle_cost`). Shared by the simulator (simulate.py, search.py) and the fast model (fast*.py); measured figures
are noted where they were fitted."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Links:
    """One GPU's links and engines. Bandwidths in GB/s (1e9 B/s) per direction, latencies in microseconds."""

    nvlink_gbps: float = 360.0       # H100/H200 NVLink 4 as NCCL reaches it (450 nominal)
    ib_gbps: float = 40.0            # one 400 Gb/s NIC per GPU as NVSHMEM reaches it (50 nominal)
    nvlink_latency_us: float = 1.5
    ib_latency_us: float = 5.0
    block_gbps: float = 40.0         # one comm thread block's load/store rate over NVLink (an assumption)
    local_gbps: float = 60.0         # one thread block streaming its own GPU's memory (bytes read + written)
    ce_gbps: float = 300.0           # copy-engine DMA to a peer
    ce_local_gbps: float = 1500.0    # copy-engine DMA inside one GPU (the all-gather's own shard, before its kernel)
    put_issue_us: float = 0.5        # a block's cost of issuing one NVSHMEM put (the data moves without it)
    put_by_blocks: bool = False      # puts go to load/store-mapped peers (forced puts on one node, node groups of
    #                                  one host): NVSHMEM's P2P transport copies with the issuing block's threads,
    #                                  which stay busy for the whole transfer, at put_block_gbps
    put_block_gbps: float = 15.0     # one block's NVSHMEM put to a mapped peer (H200, 2026-12-04: 15.8 GB/s with
    #                                  one block, 14.6 each with two)
    model_ingress: bool = True       # receivers' links are shared too (False: as link emulation paces, senders only)
    beside_gemm: float = 0.8         # comm blocks' rates while a GEMM runs on the other SMs, as a share of their rates
    #                                  alone (H100 2026-12-05, fused calls' stage times: all-gather 23-25 GB/s per
    #                                  block against 35 alone, whole-row reduce units >= 22 against 30; fitted with
    #                                  unit_us and gemm_beside_comm to 12 fused GEMM+RS runs, tests/test_simulate.py)
    pass_latency_us: float = 0.7     # a reduce block's pass waits for one round of loads per source (block_sum: 32
    #                                  KiB per source per pass): small units are latency-bound, not rate-bound
    unit_us: float = 5.5             # a reduce unit's fixed cost: its counter waits, barriers, pacing and the first
    #                                  round of loads (H100 2026-12-05: units 7 N-tiles x 8 rows wide ran 7.7 us each
    #                                  on 2 blocks, where their bytes alone take ~5 at the blocks' rate)
    gemm_beside_comm: float = 1.03   # a GEMM tile's time beside a comm kernel, over its time alone (H100 2026-12-05:
    #                                  the fused calls' GEMM stage 1.05-1.21x gemm_only on the same SMs, a part of it
    #                                  the swizzle's, SWIZZLE_COST; 2026-12-07, autosweep2/4 at M 4096-16384: fused
    #                                  calls within 0.98-1.1x of their GEMM's time alone)

    def __post_init__(self) -> None:
        for f in ("nvlink_gbps", "ib_gbps", "block_gbps", "local_gbps", "ce_gbps", "put_block_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Links.{f} must be > 0, got {getattr(self, f)!r}")
        if not self.gemm_beside_comm >= 1:
            raise ValueError(f"Links.gemm_beside_comm must be >= 1, got {self.gemm_beside_comm!r}")
        if not 0 < self.beside_gemm <= 1:
            raise ValueError(f"Links.beside_gemm must be in (0, 1], got {self.beside_gemm!r}")
        for f in ("nvlink_latency_us", "ib_latency_us", "put_issue_us", "pass_latency_us", "unit_us"):
            if getattr(self, f) < 0:
                raise ValueError(f"Links.{f} must be >= 0, got {getattr(self, f)!r}")

    def beside(self) -> "Links":
        """These links with the comm blocks' rates they have beside a running GEMM (a fused call)."""
        f = self.beside_gemm
        if f == 1.0:
            return self
        return dataclasses.replace(self, block_gbps=self.block_gbps * f, local_gbps=self.local_gbps * f,
                                   put_block_gbps=self.put_block_gbps * f, beside_gemm=1.0)

    def gbps(self, cls: int) -> float:
        return self.ib_gbps if cls else self.nvlink_gbps

    def latency(self, cls: int) -> float:
        return self.ib_latency_us if cls else self.nvlink_latency_us


def emulated_links(gbps: float, latency_us: float, ib_gbps: Optional[float] = None,
                   ib_latency_us: Optional[float] = None, **kw) -> Links:
    """The links as `FLUX_SHMEM_LINK_GBPS` pacing makes them on one GPU: senders' links only, copies at memory
    speed otherwise."""
    # One 512-thread comm block under MPS, measured on an H200 2026-12-03 (GPU check comm_block_rates, no pacing):
    # 32-38 GB/s for the all-gather's stores into another PE's buffer, 30-32 GB/s for the reduce-scatter's loads
    # of every node PE's addend plus its store.
    kw.setdefault("block_gbps", 35.0)
    kw.setdefault("local_gbps", 32.0)
    return Links(nvlink_gbps=gbps, ib_gbps=ib_gbps if ib_gbps else gbps, nvlink_latency_us=latency_us,
                 ib_latency_us=latency_us if ib_latency_us is None else ib_latency_us, model_ingress=False, **kw)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """The persistent GEMM: tile shape, cluster size along M, and one work tile's time on one SM."""

    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2
    tile_us: float = 100.0
    swizzle_cost: bool = False  # tiles of narrow swizzle groups take longer (SWIZZLE_COST)
    plain_swizzle: int = 8      # the plain GEMM's swizzle at this N (kernels.config.swizzle_cap_for_n): no cost below

    @staticmethod
    def from_rate(k: int, tflops_per_sm: float, tile_m: int = 128, tile_n: int = 256, cluster_m: int = 2,
                  tile_fixed_us: float = 0.0, swizzle_cost: bool = False, plain_swizzle: int = 8) -> "Gemm":
        """A tile's time from the K of the problem and one SM's rate (TFLOP/s of the whole GPU / its SMs), plus a
        fixed cost per tile (its epilogue)."""
        return Gemm(tile_m, tile_n, cluster_m, 2.0 * tile_m * tile_n * k / (tflops_per_sm * 1e12) * 1e6 + tile_fixed_us,
                    swizzle_cost, plain_swizzle)

    def beside_comm(self, links: "Links") -> "Gemm":
        """This GEMM as it runs beside a comm kernel (a fused call)."""
        f = links.gemm_beside_comm
        return self if f == 1.0 else dataclasses.replace(self, tile_us=self.tile_us * f)


# A GEMM whose swizzle groups hold few cluster rows re-reads B from memory for every group (B rarely fits in L2
# beside A): measured on an H100 under MPS (2026-12-06, fused GEMM+RS's GEMM alone, 24-60 CTAs, K 1024-3584 per PE)
# swizzle 1 ran 1.02-1.16x (most 1.07-1.09x) the time of swizzle 4 or 8, which ran alike. Tile time factor by the
# swizzle (groups of fewer rows than the GEMM has), against the plain GEMM's swizzle at that N (the decomposed
# paths run it): at N <= 4096 per PE the plain GEMM itself runs swizzle 1, measured best there (a narrow B panel is
# read by every group anyway, kernels/config.py swizzle_cap_for_n), so a fused swizzle 1 costs nothing more.
# (H100 2026-12-07, autosweep2: AllGatherGEMM 3584 x 8192 per PE, M 16384, fused 2963 us against its GEMM alone
# ~2890, where the cost made the model say 4099 and auto take the decomposed path.)
SWIZZLE_COST = {1: 1.08, 2: 1.03}
PLAIN_SWIZZLE = 8


def swizzle_cost(g: Gemm, swizzle: int, tiles_m: int) -> float:
    rows = -(-tiles_m // g.cluster_m)
    narrow = swizzle < min(rows, g.plain_swizzle)
    return SWIZZLE_COST.get(swizzle, 1.0) if g.swizzle_cost and narrow else 1.0
