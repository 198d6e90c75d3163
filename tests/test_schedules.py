"""The communication schedules (csrc/include/flux_shmem/comm_schedule.cuh), compiled for the host and checked:
every chunk reaches every PE exactly once, along a path whose data is already there; reduce-scatter units tile
every segment exactly once without crossing a GEMM tile."""
from __future__ import annotations

import collections
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KINDS = {0: "local", 1: "put", 2: "direct", 3: "forward"}


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on PATH")
    exe = tmp_path_factory.mktemp("sched") / "schedule_dump"
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{ROOT / 'csrc' / 'include'}", str(ROOT / "tests/cpp/schedule_dump.cpp"),
                    "-o", str(exe)], check=True)

    def run(*args) -> list[list[int]]:
        out = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True).stdout
        return [list(map(int, line.split())) for line in out.splitlines()]
    return run


TOPOLOGIES = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 8), (8, 4), (16, 8), (8, 1), (6, 3), (12, 4)]


@pytest.mark.parametrize("world,L", TOPOLOGIES)
@pytest.mark.parametrize("chunks", [1, 3])
def test_all_gather_delivers_every_chunk_once(dump, world, L, chunks):
    units = dump("ag", world, L, chunks)
    assert len(units) == world * world * chunks
    arrivals = collections.Counter()
    by_pe = collections.defaultdict(list)
    for pe, kind, src, dest, c in units:
        by_pe[pe].append((KINDS[kind], src, dest, c))
        arrivals[(src, dest, c)] += 1
        node, dnode = pe // L, dest // L
        if KINDS[kind] == "local":
            assert src == dest == pe
        elif KINDS[kind] == "put":  # across nodes, only to my own local index
            assert src == pe and dnode != node and dest % L == pe % L
        elif KINDS[kind] == "direct":
            assert src == pe and dnode == node and dest != pe
        else:  # forward: a shard that came over the network from my local index on another node
            assert src // L != node and src % L == pe % L and dnode == node and dest != pe
    # every PE ends up with every chunk of every shard exactly once
    assert arrivals == collections.Counter({(s, d, c): 1 for s in range(world) for d in range(world)
                                            for c in range(chunks)})
    for pe, lst in by_pe.items():
        kinds = [k for k, *_ in lst]
        # phases in order: local copies first, network puts before NVLink stores, forwards last
        order = {"local": 0, "put": 1, "direct": 2, "forward": 3}
        assert kinds == sorted(kinds, key=order.get)
        # every destination gets chunk 0 of a phase before chunk 1
        for k in ("put", "direct"):
            cs = [c for kk, s, d, c in lst if kk == k]
            assert cs == sorted(cs)


def rs_reference_units(world, L, Ms, ur, pe):
    nodes, node, local = world // L, pe // L, pe % L
    segs = [((node + j) % nodes) * L + local for j in range(1, nodes + 1)]
    out = []
    for s in segs:
        lo, hi = s * Ms, (s + 1) * Ms
        cuts = sorted({lo, hi, *range((lo // ur + 1) * ur, hi, ur)})
        out += [(0, s, u, a, b) for u, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    if nodes > 1:
        lo, hi = pe * Ms, (pe + 1) * Ms
        cuts = sorted({lo, hi, *range((lo // ur + 1) * ur, hi, ur)})
        out += [(1, pe, u, a, b) for u, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return out


@pytest.mark.parametrize("world,L", TOPOLOGIES)
@pytest.mark.parametrize("Ms,ur", [(128, 128), (100, 32), (1000, 64), (7, 4), (256, 1)])
def test_reduce_scatter_units(dump, world, L, Ms, ur):
    units = dump("rs", world, L, Ms, ur)
    by_pe = collections.defaultdict(list)
    for pe, phase, seg, u, lo, hi in units:
        by_pe[pe].append((phase, seg, u, lo, hi))
        assert seg * Ms <= lo < hi <= (seg + 1) * Ms
        assert lo // ur == (hi - 1) // ur  # inside one aligned block, so inside one GEMM tile (ur divides it)
        assert u < Ms // ur + 2  # fits the receive-signal slots
    covered = collections.Counter()
    for pe in range(world):
        assert by_pe[pe] == rs_reference_units(world, L, Ms, ur, pe)
        for phase, seg, u, lo, hi in by_pe[pe]:
            if phase == 0:
                covered[seg] += hi - lo
    # phase A: each segment is summed once by each node (by the PE with the segment's local index)
    assert covered == {s: Ms * (world // L) for s in range(world)}
    # remote segments before my own node's
    for pe in range(world):
        segs = [seg // L for phase, seg, *_ in by_pe[pe] if phase == 0]
        assert segs[-1] == pe // L
