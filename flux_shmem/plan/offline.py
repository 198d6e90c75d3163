"""PlanInputs without a GPU or a job: what an op built with given arguments would agree on, for planning offline
(the planner's CPU tests and benchmarks/plan_speed.py). The ops derive the same fields from their arguments and
their device (ops/_fused.FusedGEMM.plan_inputs)."""
from __future__ import annotations

from ..kernels import registry
from . import schedules, search
from .costs import Links
from .inputs import PlanInputs

# The fused AllGatherGEMM's configurations as the op offers them on a 132-SM Hopper (128-row tiles, 2 x 1
# clusters, cooperative): what the planner chooses among.
AG_FUSED = tuple(c for c in registry.names() if (registry.get(c).tile_m, registry.get(c).cluster_m) == (128, 2)
                 and not registry.get(c).pingpong)


def inputs(family: str, world: int, node_size: int, n: int, k: int, max_m: int, **kw) -> PlanInputs:
    """The agreed inputs of an op (`family`: 'ag_gemm' or 'gemm_rs') of shard shape N x K and at most `max_m`
    rows, built with its defaults on one 132-SM GPU per PE, in bf16, mode 'auto'; `kw` replaces any field."""
    base = dict(family=family, world=world, node_size=node_size, n=n, k=k, dtype="bf16", elem_bytes=2, mode="auto",
                budget_sms=132, sms=132, cluster_m=2, links=Links(), comm_blocks=None)
    if family == "ag_gemm":
        base.update(fused_configs=AG_FUSED, plain_configs=None,
                    engines=search.ag_engines(node_size == world, False, world),
                    chunk_rows=schedules.fused_chunk_rows(max_m // world, 2 * k, 128),
                    decomposed_comm_blocks=max(search.AG_COMM_BLOCKS))
    else:
        base.update(fused_configs=(registry.DEFAULT,), plain_configs=(registry.DEFAULT,),
                    unit_rows=schedules.default_unit_rows(n, 2, 128),
                    decomposed_comm_blocks=max(search.RS_COMM_BLOCKS))
    base.update(kw)
    return PlanInputs(**base)
