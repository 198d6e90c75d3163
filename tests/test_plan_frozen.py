"""Issue 39: moving the planner into its own package changed no plan. The call plans of a grid of ops, worlds,
shapes, M and ranks, the simulator's own plans on a smaller grid and the GEMM chooser's choices were frozen once
from the code before the move (tests/data/frozen_plans.json); this test plans the same grid now and compares
every field, the tile orders and the predicted times (to 0.01 us) included.

    python3 tests/test_plan_frozen.py --write     # re-freeze (only for a change that means to change plans)
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flux_shmem.plan.offline import inputs  # noqa: E402

from flux_shmem.kernels import config as kconfig  # noqa: E402
from flux_shmem.kernels import registry  # noqa: E402
from flux_shmem.plan import call as C  # noqa: E402
from flux_shmem.plan import costs  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "frozen_plans.json"
WORLDS = ((2, 2), (4, 4), (8, 8), (16, 8))
SHAPES = {"ag_gemm": ((3584, 8192), (1280, 8192), (1792, 4096)),
          "gemm_rs": ((8192, 3584), (8192, 1024), (4096, 1792))}
MS = (8, 64, 136, 512, 1000, 2048, 3000, 4096, 8192, 12000, 16384, 32768)
VARIANTS = {"default": {}, "blocks8": dict(comm_blocks=8), "emulated": dict(links=costs.emulated_links(87.3, 1.5)),
            "mode_fused": dict(mode="fused"), "fp8": dict(dtype="e4m3")}
CHOOSER_SHAPES = ((64, 3584, 8192), (1024, 1280, 8192), (4096, 1280, 8192), (8192, 3584, 8192),
                  (1024, 7392, 8192), (16384, 8192, 3584), (2048, 768, 4096), (512, 4096, 512),
                  (8192, 28672, 8192), (3000, 5000, 6000))


def summary(plan) -> dict:
    p = plan.predicted
    g = plan.gemm
    return {"path": plan.path, "engine": plan.engine, "comm_blocks": plan.comm_blocks, "gemm_sms": plan.gemm_sms,
            "swizzle": plan.swizzle, "tail": plan.tail, "tail_blocks": plan.tail_blocks,
            "group_tiles": plan.group_tiles,
            "gemm": None if g is None else [g.config, g.swizzle, g.split, g.chunks, g.source],
            "order": None if plan.order is None else [len(plan.order), hashlib.sha1(
                ",".join(map(str, plan.order)).encode()).hexdigest()[:16]],
            "predicted": None if p is None else [round(p.fused_us, 2), round(p.decomposed_us, 2),
                                                 round(p.comm_us, 2)],
            "reason": plan.reason}


def grid() -> dict:
    """Every plan of the grid, keyed by a readable name."""
    out = {}
    for family, shapes in SHAPES.items():
        for world, node in WORLDS:
            for n, k in shapes:
                for variant, kw in VARIANTS.items():
                    if variant != "default" and (world, n) not in ((4, shapes[0][0]), (16, shapes[0][0])):
                        continue
                    kw = dict(kw)
                    if kw.get("dtype") == "e4m3":  # what an fp8 op agrees on: its runnable configuration
                        fp8 = (registry.default_for("e4m3"),)
                        kw.update(elem_bytes=1 if family == "ag_gemm" else 2, fused_configs=fp8,
                                  plain_configs=None if family == "ag_gemm" else fp8)
                    inp = inputs(family, world, node, n, k, 32768, **kw)
                    for m in MS:
                        m = max(world, m // world * world)
                        for layout in (("nk",) if variant == "fp8" else ("nk", "kn")):
                            for rank in sorted({0, world - 1}):
                                key = f"{family} W{world}/{node} {n}x{k} {variant} M{m} {layout} r{rank}"
                                out[key] = summary(C.plan_call(inp, m, layout, rank))
    for family, shapes in SHAPES.items():  # the simulator itself (plan_call_full), a few points
        n, k = shapes[0]
        for world, node in ((4, 4), (8, 8)):
            inp = inputs(family, world, node, n, k, 32768)
            for m in (512, 4096, 8192):
                out[f"full {family} W{world}/{node} {n}x{k} M{m}"] = summary(C.plan_call_full(inp, m, "nk", 0))
    for m, n, k in CHOOSER_SHAPES:
        for dt in ("bf16", "e4m3"):
            for sms in (132, 64, 30):
                c = kconfig.choose(m, n, k, dt, "nk", sms, use_cache=False)
                out[f"choose {m}x{n}x{k} {dt} sm{sms}"] = [c.config, c.swizzle, c.split, c.chunks, c.reason,
                                                           c.estimate_us]
    return out


def test_plans_match_the_frozen_grid():
    want = json.loads(DATA.read_text())
    got = json.loads(json.dumps(grid()))  # (tuples as lists, as frozen)
    assert set(got) == set(want), (sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5])
    diff = [k for k in want if got[k] != want[k]]
    assert not diff, f"{len(diff)} of {len(want)} plans changed, e.g. {diff[0]}: {want[diff[0]]} -> {got[diff[0]]}"
    assert len(want) > 2000


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(grid(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {DATA}")
