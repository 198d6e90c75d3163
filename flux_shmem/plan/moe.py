"""Mixture-of-experts routing as the grouped ops walk it (issue 38).

A token row t of the gathered A (every PE's shard, PE order) goes to the experts ids[t, 0..topk): its (token,
slot) pairs, laid out expert by expert (stable: token order inside an expert), are the grouped GEMM's rows. Expert
e owns rows [offs[e-1], offs[e]) (`torch._grouped_mm`'s cumulative ends); an expert without tokens owns none.

`route` makes that layout from the ids with torch ops only (no host synchronisation, so a CUDA graph can capture
it): the grouped row -> flat slot permutation, its inverse (the combine reads each token's topk results by it) and
the offsets. The tile tables the fused kernel will walk (issue 38's grouped AllGather GEMM: tiles never cross an
expert, each waits only on the all-gather chunks of the rows it reads) are mirrored here in numpy
(`group_tiles`, `tile_waits`, `tile_order`) for the CPU tests and the planner.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import heapq

import numpy as np
import torch

from . import costs
from .fast_ag import ag_arrivals  # (the dense AllGatherGEMM's arrival model: the same all-gather)


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each (token, slot) pair of a gathered batch goes: the grouped GEMMs' row layout. Tensors on the
    ops' device; made by `route` (AllGatherGroupGEMM returns it, GroupGEMMReduceScatter takes it back).

    One block (chunk_tokens 0): every row, expert by expert; offs [experts]. Blocked (the pipelined ops): the
    rows come in blocks, block s holding the pairs of tokens [s * chunk_tokens, (s + 1) * chunk_tokens) of every
    PE's shard of shard_tokens, expert by expert inside the block; offs [blocks, experts], each row's ends
    relative to its block's first row (what one grouped GEMM per block takes)."""

    ids: torch.Tensor                 # [M, topk] int64: expert of each (token, slot), gathered rows (PE order)
    weights: Optional[torch.Tensor]   # [M, topk] fp32: the router's combine weights (None: GroupGEMMReduceScatter
    #                                   then needs them per call)
    perm: torch.Tensor                # [M * topk] int64: the flat slot t * topk + j of each grouped row
    inverse: torch.Tensor             # [M * topk] int64: the grouped row of each flat slot
    offs: torch.Tensor                # int32 cumulative end rows: [experts], or [blocks, experts] per block
    num_experts: int
    shard_tokens: int = 0             # blocked: tokens per PE
    chunk_tokens: int = 0             # blocked: tokens of each PE's shard per block (0: one block)
    # Expert parallel: this PE's experts [first_expert, first_expert + local_experts) only (0: every expert, TP).
    # Their pairs come first, expert by expert (offs [local_experts]); the other pairs follow, computed by no
    # expert here (their rows hold garbage), and `local` [M, topk] marks the slots whose expert is here.
    first_expert: int = 0
    local_experts: int = 0
    local: Optional[torch.Tensor] = None

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def topk(self) -> int:
        return self.ids.shape[1]

    @property
    def rows(self) -> torch.Tensor:
        """[M * topk] int64: the gathered token row each grouped row reads."""
        return self.perm // self.topk

    @property
    def blocked(self) -> bool:
        return self.chunk_tokens > 0

    @property
    def experts_here(self) -> int:
        """Experts whose rows this layout groups: every one (TP), or this PE's (EP)."""
        return self.local_experts or self.num_experts

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """Per block: (first grouped row, end row, first token, end token inside each PE's shard); one block:
        every row and token."""
        if not self.blocked:
            return [(0, self.tokens * self.topk, 0, self.tokens)]
        m, c, k = self.shard_tokens, self.chunk_tokens, self.topk
        world = self.tokens // m
        return [(world * k * t0, world * k * min(m, t0 + c), t0, min(m, t0 + c)) for t0 in range(0, m, c)]

    def block_offs(self, s: int) -> torch.Tensor:
        """Block s's [experts] int32 ends, relative to its first row."""
        return self.offs[s] if self.blocked else self.offs

    def counts(self) -> torch.Tensor:
        """[experts here] int64: rows per expert (a device tensor; reading it on the host synchronises)."""
        offs = self.offs.to(torch.int64).reshape(-1, self.experts_here)
        return torch.diff(offs, dim=1, prepend=offs.new_zeros(offs.shape[0], 1)).sum(0)


def route(ids: torch.Tensor, num_experts: int, weights: Optional[torch.Tensor] = None, *,
          shard_tokens: int = 0, chunk_tokens: int = 0) -> Routing:
    """The grouped layout of `ids` ([M, topk] integer expert ids, each in [0, num_experts): not checked here,
    see `check_ids`). Stable: inside an expert (of a block), rows keep token order, then slot order.
    chunk_tokens > 0 (with shard_tokens, the tokens of each PE; fewer than shard_tokens): blocked (see Routing)."""
    m, topk = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    blocks = 1
    if chunk_tokens > 0:
        if shard_tokens <= 0 or m % shard_tokens:
            raise ValueError(f"blocked routing needs shard_tokens dividing the {m} tokens, got {shard_tokens}")
        blocks = -(-shard_tokens // chunk_tokens)
        if blocks == 1:
            shard_tokens = chunk_tokens = 0
    if blocks > 1:
        token = torch.arange(m, device=ids.device, dtype=torch.int64)
        block = (token % shard_tokens) // chunk_tokens
        # (block, expert) keys; an id outside [0, E) (check_ids=False) takes its block's last key, after the
        # experts: its row is computed by no expert, but stays inside its block, so no block's ends leave it
        flat = block.repeat_interleave(topk) * (num_experts + 1) + \
            torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    # (stable sort by key; a token's slots name distinct experts in top-k routing, but duplicates stay correct)
    sorted_ids, perm = torch.sort(flat, stable=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    # offs[e] = rows with key <= e, from the sorted keys (searchsorted: no host sync, unlike bincount on CUDA)
    if blocks > 1:
        keys = torch.arange(blocks * (num_experts + 1), device=ids.device, dtype=torch.int64)
        offs = torch.searchsorted(sorted_ids, keys, right=True).view(blocks, num_experts + 1)[:, :num_experts]
        world = m // shard_tokens
        starts = torch.arange(blocks, device=ids.device, dtype=torch.int64) * (world * topk * chunk_tokens)
        offs = offs - starts[:, None]
    else:
        offs = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=ids.device, dtype=torch.int64),
                                  right=True)
    return Routing(ids.to(torch.int64), None if weights is None else weights.to(torch.float32), perm, inverse,
                   offs.to(torch.int32).contiguous(), num_experts, shard_tokens if blocks > 1 else 0,
                   chunk_tokens if blocks > 1 else 0)


def local_slots(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Bool, ids' shape: the slots whose expert is in [first, first + count) (this PE's, expert parallel)."""
    return (ids >= first) & (ids < first + count)


def route_local(ids: torch.Tensor, num_experts: int, first: int, count: int,
                weights: Optional[torch.Tensor] = None) -> Routing:
    """The expert-parallel layout of `ids`: the pairs whose expert is in [first, first + count) (this PE's),
    expert by expert, token order inside an expert, then every other pair (ids outside [0, num_experts) among
    them: not checked here, see `check_ids`); offs [count]. Torch ops only, no host synchronisation."""
    flat = ids.reshape(-1).to(torch.int64)
    local = local_slots(flat, first, count)
    key = torch.where(local, flat - first, count)
    sorted_keys, perm = torch.sort(key, stable=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    offs = torch.searchsorted(sorted_keys, torch.arange(count, device=ids.device, dtype=torch.int64), right=True)
    return Routing(ids.to(torch.int64), None if weights is None else weights.to(torch.float32), perm, inverse,
                   offs.to(torch.int32), num_experts, first_expert=first, local_experts=count,
                   local=local.view(ids.shape))


def check_ids(ids: torch.Tensor, num_experts: int, shard_rows: int) -> None:
    """Raise naming the first bad id, its token row and the PE whose shard holds it, when any id is outside
    [0, num_experts). On gathered ids every PE sees the same values, so every PE raises alike. Reads two scalars
    on the host (a synchronisation: the ops skip it with check_ids=False, e.g. inside CUDA-graph capture)."""
    bad = (ids < 0) | (ids >= num_experts)
    if bool(bad.any()):
        where = int(torch.nonzero(bad.reshape(-1))[0])
        t, j = divmod(where, ids.shape[1])
        raise ValueError(f"expert id {int(ids.reshape(-1)[where])} at token {t} slot {j} (PE {t // shard_rows}'s "
                         f"shard row {t % shard_rows}) is outside [0, {num_experts}): the router's top-k ids must "
                         f"index the {num_experts} experts the op was built for")


# ------------------------------------------------------------------------------------------------------------
# Reference layout and the fused kernel's tile tables (numpy mirrors)
def grouped_rows(ids: np.ndarray, num_experts: int, shard_tokens: int = 0, chunk_tokens: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(perm, offs) of `route` in numpy: the flat slot of each grouped row and each expert's cumulative end (of
    its block, relative to the block's first row, [blocks, experts], when chunk_tokens makes several blocks)."""
    ids = np.asarray(ids, dtype=np.int64)
    m, topk = ids.shape
    blocks = -(-shard_tokens // chunk_tokens) if chunk_tokens > 0 else 1
    if blocks == 1:
        flat = ids.reshape(-1)
        perm = np.argsort(flat, kind="stable")
        return perm, np.searchsorted(flat[perm], np.arange(num_experts), side="right")
    token = np.repeat(np.arange(m), topk)
    block = (token % shard_tokens) // chunk_tokens
    flat = ids.reshape(-1)
    key = block * (num_experts + 1) + np.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    perm = np.argsort(key, kind="stable")
    offs = np.searchsorted(key[perm], np.arange(blocks * (num_experts + 1)), side="right")
    starts = np.searchsorted(block[perm], np.arange(blocks), side="left")
    return perm, offs.reshape(blocks, num_experts + 1)[:, :num_experts] - starts[:, None]


def group_tiles(offs: Sequence[int], tile_m: int) -> np.ndarray:
    """The grouped GEMM's M-tiles: [tiles, 3] (expert, first grouped row, rows), expert by expert, each expert's
    rows cut into tiles of tile_m (its last tile shorter; an expert without rows has no tile), as CUTLASS's grouped
    scheduler walks one problem per expert."""
    ends = np.asarray(offs, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    out = []
    for e, (lo, hi) in enumerate(zip(starts, ends)):
        for r in range(lo, hi, tile_m):
            out.append((e, r, min(tile_m, hi - r)))
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def tile_waits(tiles: np.ndarray, token_rows: np.ndarray, shard_rows: int, chunk_rows: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """What each tile's TMA producer must wait for before loading its A rows: the all-gather chunks holding them,
    as CSR (offsets [tiles + 1], chunk ids; a chunk id is pe * chunks_per_shard + chunk, the AllGather's flag
    index), each tile's chunks distinct and ascending. token_rows: the gathered token row of each grouped row."""
    per_shard = -(-shard_rows // chunk_rows)
    offsets, chunks = [0], []
    for _, r0, n in tiles:
        t = token_rows[r0:r0 + n]
        mine = np.unique((t // shard_rows) * per_shard + (t % shard_rows) // chunk_rows)
        chunks.append(mine)
        offsets.append(offsets[-1] + len(mine))
    return np.array(offsets, dtype=np.int64), (np.concatenate(chunks) if chunks else np.zeros(0, np.int64))


def tile_order(offsets: np.ndarray, chunks: np.ndarray, pe: int, world: int, per_shard: int) -> np.ndarray:
    """The order PE `pe` visits the tiles in: by the arrival rank of the last chunk each waits on (its own shard
    first, then the peers pe + 1, pe + 2, ... as the ring-ordered all-gather delivers them; chunk by chunk inside a
    shard), ties in tile order. A tile whose rows are all local needs no wait and goes first."""
    src = chunks // per_shard
    rank = ((src - pe) % world) * per_shard + chunks % per_shard
    last = np.array([rank[a:b].max() if b > a else -1 for a, b in zip(offsets[:-1], offsets[1:])], dtype=np.int64)
    return np.argsort(last, kind="stable")


# ------------------------------------------------------------------------------------------------------------
# The fused AllGather + grouped GEMM in the planner's model (what the fused kernel would give, for mode 'auto'
# and for choosing its chunking)
@dataclasses.dataclass(frozen=True)
class MoEEstimate:
    fused_us: float        # the grouped GEMM walking tiles in `tile_order`, each waiting for its chunks
    decomposed_us: float   # the all-gather, then the grouped GEMM on every SM
    comm_us: float         # the all-gather alone (its last chunk at this PE)
    gemm_us: float         # the grouped GEMM alone on every SM

    @property
    def hidden(self) -> float:
        """The share of the communication the fused call hides (1: all, 0: none)."""
        return max(0.0, min(1.0, (self.decomposed_us - self.fused_us) / self.comm_us)) if self.comm_us > 0 else 1.0


def grouped_span(ready: np.ndarray, rows: np.ndarray, tiles_n: int, clusters: int, gemm: costs.Gemm,
                 order: Optional[np.ndarray] = None) -> float:
    """A persistent grouped GEMM's makespan: its M-tiles (each `rows` rows, at most tile_m; its A rows there at
    `ready`) walked in `order` (default: as given), every M-tile's tiles_n work items in turn, each item on the
    first free of `clusters` clusters once its tile is ready, taking the tile time (a short M-tile costs a whole
    tile: the MMA shape is fixed)."""
    order = np.arange(len(ready)) if order is None else order
    free = [0.0] * max(1, clusters)
    end = 0.0
    for i in order:
        r = float(ready[i])
        for _ in range(tiles_n):
            t = max(heapq.heappop(free), r) + gemm.tile_us
            heapq.heappush(free, t)
            end = max(end, t)
    return end


def fused_estimate(ids: np.ndarray, num_experts: int, *, world: int, node_size: int, pe: int, hidden: int,
                   n: int, elem_bytes: int, gemm: costs.Gemm, sms: int, comm_blocks: int, chunk_rows: int,
                   links: costs.Links = costs.Links(), decomposed_comm_blocks: int = 16) -> MoEEstimate:
    """PE `pe`'s AllGatherGroupGEMM in the model: every PE's ids [M, topk] (PE order), the all-gather's arrivals
    (`fast_ag.ag_arrivals`: chunks of chunk_rows token rows, `comm_blocks` blocks beside the GEMM), the grouped
    tiles (`group_tiles`) each ready when the last chunk it reads lands (`tile_waits`), walked by last arrival
    (`tile_order`) on the SMs left beside the comm kernel; against the all-gather then the grouped GEMM on all
    `sms` (its all-gather alone on decomposed_comm_blocks blocks, as the decomposed op runs it). A tile's time is
    `gemm`'s (K = hidden) at tile_m x tile_n; n is the experts' output width per PE."""
    ids = np.asarray(ids)
    m_total = ids.shape[0]
    if m_total % world:
        raise ValueError(f"{m_total} tokens do not split over {world} PEs")
    shard = m_total // world
    perm, offs = grouped_rows(ids, num_experts)
    tiles = group_tiles(offs, gemm.tile_m)
    woff, wch = tile_waits(tiles, perm // ids.shape[1], shard, chunk_rows)
    per_shard = -(-shard // chunk_rows)
    tiles_n = -(-n // gemm.tile_n)
    clusters_all = max(1, sms // gemm.cluster_m)
    gemm_us = grouped_span(np.zeros(len(tiles)), tiles[:, 2], tiles_n, clusters_all, gemm)
    arr = ag_arrivals(world, node_size, shard, hidden * elem_bytes, chunk_rows, comm_blocks, links.beside())
    at = arr.of(pe).ravel()                                          # [shard * per_shard + chunk]
    ready = np.array([at[wch[a:b]].max() if b > a else 0.0 for a, b in zip(woff[:-1], woff[1:])])
    order = tile_order(woff, wch, pe, world, per_shard)
    beside = gemm.beside_comm(links)
    fused = max(arr.end, grouped_span(ready, tiles[:, 2], tiles_n, max(1, (sms - comm_blocks) // gemm.cluster_m),
                                      beside, order))
    alone = ag_arrivals(world, node_size, shard, hidden * elem_bytes, chunk_rows, decomposed_comm_blocks, links)
    comm = float(alone.of(pe).max())
    return MoEEstimate(fused, comm + gemm_us, comm, gemm_us)
