"""Which launcher flux_shmem.init() bootstraps over (pure selection, mocked environments), the runtime's import
order (no cycles: imports go downward only), and the public names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flux_shmem
from flux_shmem.runtime import bootstrap
from flux_shmem.runtime.host import MPI, TORCH, choose_launcher

ROOT = Path(__file__).resolve().parents[1]

OPENMPI = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}


@pytest.mark.parametrize("env, torch_init, expected", [
    (OPENMPI, False, MPI),                                      # mpirun / flux-launch
    ({"PMIX_RANK": "1", "SLURM_PROCID": "1"}, False, MPI),      # srun --mpi=pmix
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, False, MPI),           # MPICH / Hydra
    (TORCHRUN, False, TORCH),                                   # torchrun
    ({**TORCHRUN, **OPENMPI}, False, MPI),                      # a script exporting RANK under mpirun: MPI
    ({**OPENMPI, "MASTER_ADDR": "h", "MASTER_PORT": "1"}, True, MPI),  # run.py: NCCL group made from MPI
    ({"RANK": "0", "WORLD_SIZE": "2"}, False, MPI),             # no LOCAL_RANK: not torchrun's environment
    ({}, True, TORCH),                                          # init_process_group(...) called by hand
    ({}, False, MPI),                                           # a plain process: MPI singleton
    ({**OPENMPI, "FLUX_SHMEM_BOOTSTRAP": "torch"}, False, TORCH),
    ({**TORCHRUN, "FLUX_SHMEM_BOOTSTRAP": " MPI "}, False, MPI),
])
def test_choose_launcher(env, torch_init, expected):
    assert choose_launcher(env, torch_initialized=torch_init) == expected


def test_choose_launcher_rejects_unknown_override():
    with pytest.raises(ValueError, match="'mpi'.*'torch'"):
        choose_launcher({"FLUX_SHMEM_BOOTSTRAP": "nccl"})


def test_comm_and_group_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        bootstrap.host_collectives(comm=object(), group=object())


def test_mpi_host_wraps_a_comm():
    class Comm:
        def Get_rank(self):
            return 1

        def Get_size(self):
            return 3

        def allgather(self, obj):
            return [obj] * 3

        def bcast(self, data, root):
            return b"id" if data is None else data

    host = bootstrap.host_collectives(comm=Comm())
    assert (host.name, host.rank, host.size) == ("mpi", 1, 3)
    assert host.allgather(5) == [5, 5, 5] and host.broadcast_bytes(None) == b"id"


def test_torch_host_needs_torchrun_env(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    from flux_shmem.runtime.host import torch_host
    with pytest.raises(flux_shmem.FluxShmemError, match="MASTER_ADDR.*torchrun"):
        torch_host()


# ------------------------------------------------------------------------------------------------ import order
LAYERS = ["errors", "kernels", "runtime", "plan", "ops", "nn"]    # a package imports only lower ones
RUNTIME = {"topology": 0, "host": 0, "partition": 0, "stall": 0, "state": 1, "sm_budget": 1, "collective": 2,
           "symmetric": 3, "signals": 4, "bootstrap": 5}


def imports_of(path: Path, package: str) -> set[str]:
    """flux_shmem modules a file imports (relative or absolute, also inside functions), as dotted names (for `from
    pkg import x` both pkg and pkg.x: x may be a module)."""
    rel = path.relative_to(ROOT).with_suffix("").parts  # ('flux_shmem', 'runtime', 'signals')
    here = list(rel[:-1])  # the package a relative import starts from
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = ([mod] if node.module else []) + [f"{mod}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {n for n in names if n.startswith(package)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package)}
    return found


def test_runtime_imports_go_downward_only():
    for name, level in RUNTIME.items():
        for dep in imports_of(ROOT / f"flux_shmem/runtime/{name}.py", "flux_shmem.runtime."):
            other = dep.split(".")[2]
            assert RUNTIME[other] < level, f"runtime/{name}.py imports runtime/{other}.py (same or higher level)"


def test_packages_import_downward_only():
    for pkg in LAYERS:
        files = [ROOT / f"flux_shmem/{pkg}.py"] if pkg == "errors" else \
            sorted((ROOT / "flux_shmem" / pkg).glob("*.py"))
        for f in files:
            for dep in imports_of(f, "flux_shmem."):
                other = dep.split(".")[1]
                if other in LAYERS and other != pkg:
                    assert LAYERS.index(other) < LAYERS.index(pkg), f"{f.relative_to(ROOT)} imports {dep}"


def test_public_names_still_resolve():
    from flux_shmem.runtime import state
    assert flux_shmem.get_runtime is state.get_runtime and flux_shmem.Runtime is state.Runtime
    assert flux_shmem.is_initialized() is False
    assert flux_shmem.init is bootstrap.init and flux_shmem.finalize is bootstrap.finalize
    assert bootstrap.get_runtime is state.get_runtime  # what the ops import
    assert flux_shmem.nn.ColumnParallelLinear.__name__ == "ColumnParallelLinear"
    for name in ("session", "empty", "zeros", "peer", "free", "is_symmetric", "barrier", "SignalPool",
                 "check_errors", "AllGather", "ReduceScatter", "AllGatherGEMM", "GEMMReduceScatter"):
        assert callable(getattr(flux_shmem, name)), name
