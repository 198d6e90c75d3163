"""Runtime, imports going downward only: topology.py (node layout), host.py (host collectives over MPI or
torch.distributed, launcher detection), partition.py (green-context SM partitions), stall.py (stall reports)
<- sm_budget.py, state.py (the Runtime and its getters) <- symmetric.py (symmetric memory) <- signals.py (signals,
barrier, error reports) <- bootstrap.py (init / finalize)."""
