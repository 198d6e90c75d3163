"""Build every kernel ahead of time: `python -m flux_shmem.build [--family F] [--config C|all] [--fp8] [--arch 90a]
[--jobs N] [--force] [--list]`.

Fills the on-disk cache (`$FLUX_SHMEM_CACHE`, default ~/.cache/flux_shmem) that ops load from; without it, each
family (and, for the GEMM families, each kernel configuration: flux_shmem/kernels/registry.py) is built on first
use. `--fp8` adds the GEMM families' fp8 builds (e4m3 kernels) of the same configurations. Needs nvcc but no GPU.
Each build runs its device and host passes at once; `--jobs` builds several at once.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time

from .errors import FluxShmemError
from .kernels import build as kb
from .kernels import registry


def _targets(fams: list[str], configs: list[str] | None, archs: tuple[str, ...], fp8: bool = False
             ) -> list[tuple[str, str | None, str, bool]]:
    out = []
    for fam in fams:
        if kb.is_gemm_family(fam):
            cfgs = list(registry.names()) if configs == ["all"] else (configs or [registry.DEFAULT])
            for c in cfgs:
                registry.get(c)  # unknown names fail here, before anything is built
            out += [(fam, c, arch, False) for c in cfgs for arch in archs]
            if fp8:  # all / the default: the configurations the chooser runs e4m3 with (registry.names_for)
                fp8_cfgs = list(registry.names_for("e4m3")) if configs == ["all"] else \
                    (configs or [registry.default_for("e4m3")])
                out += [(fam, c, arch, True) for c in fp8_cfgs for arch in archs]
        else:
            out += [(fam, None, arch, False) for arch in archs]
    return out


def _label(fam: str, cfg: str | None, fp8: bool) -> str:
    return fam if cfg is None else f"{fam} [{cfg}{', fp8' if fp8 else ''}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flux_shmem.build", description=__doc__.splitlines()[0])
    p.add_argument("--family", action="append", help="kernel family (csrc/<family>.cu); default: all")
    p.add_argument("--config", action="append",
                   help=f"GEMM kernel configuration, repeatable, or 'all' (default: {registry.DEFAULT}); one of "
                        f"{', '.join(registry.names())}")
    p.add_argument("--fp8", action="store_true", help="also the GEMM families' fp8 builds (e4m3 kernels)")
    p.add_argument("--arch", action="append", help="target arch such as 90a; default: $FLUX_SHMEM_ARCHS or 90a")
    p.add_argument("--jobs", type=int, default=1, help="builds at once (each runs 2 nvcc processes)")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument("--list", action="store_true", help="print families and cache paths, build nothing")
    args = p.parse_args(argv)
    try:
        fams = args.family or kb.families()
        archs = tuple(args.arch) if args.arch else kb.archs_from_env()
        targets = _targets(fams, args.config, archs, args.fp8)
        if args.list:
            for fam, cfg, arch, fp8 in targets:
                hit = kb.cached(fam, arch, cfg, fp8=fp8)
                label = _label(fam, cfg, fp8)
                print(f"{label:34s} sm_{arch:4s} {'cached ' + str(hit.cubin) if hit else 'not built'}")
            return 0

        def one(target):
            fam, cfg, arch, fp8 = target
            t0 = time.time()
            art = kb.build(fam, arch, config=cfg, fp8=fp8, force=args.force)
            label = _label(fam, cfg, fp8)
            print(f"{label:34s} sm_{arch:4s} {time.time() - t0:6.1f} s  {art.cubin.name}"
                  + (f"  {art.host_lib.name}" if art.host_lib else ""), flush=True)

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for fut in [pool.submit(one, t) for t in targets]:
                fut.result()
    except FluxShmemError as e:  # build failures, unknown configuration names
        print(f"flux_shmem.build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
