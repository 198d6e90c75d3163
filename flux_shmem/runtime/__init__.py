"""Runtime, imports going downward only: topology.py (node layout), host.py (host collectives over MPI or
torch.distributed, launcher detection), state.py (the Runtime and its getters) <- symmetric.py (symmetric memory)
<- signals.py (signals, barrier, error reports) <- bootstrap.py (init / finalize)."""
