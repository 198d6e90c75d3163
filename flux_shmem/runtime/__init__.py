"""Runtime: bootstrap over MPI (bootstrap.py), node layout (topology.py), symmetric memory (symmetric.py),
signals, barriers and device-side error reports (signals.py)."""
