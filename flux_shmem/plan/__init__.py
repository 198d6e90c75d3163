"""The fused ops' planner: how a call with a given M runs (path, engine, SM split, GEMM configuration, tile order,
reduce units, tail), as pure functions of inputs every PE agrees on.

    schedules   who sends what in which order, and the GEMM's tile orders (the tables the kernels walk)
    costs       the machine model: links, copy rates, the GEMM's tile time
    simulate    the tile-level simulator of both fused ops (the reference model)
    search      the simulator's choice of a split
    fast        the fast model's buckets of M and the GEMM in closed form; fast_ag / fast_rs: its two ops
    inputs      PlanInputs (agreed at construction) and the GEMM configuration per call shape
    offline     PlanInputs without a GPU (as an op with given arguments would agree on them)
    call        per-M call plans (plan_call, plan_call_full)
    cache       an op's bounded plan cache with pinned plans

Imports go downward only: errors <- kernels <- runtime <- plan <- ops <- nn.
"""
