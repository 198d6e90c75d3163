"""Build every kernel ahead of time: `python -m flux_shmem.build [--family F] [--arch 90a] [--force] [--list]`.

Fills the on-disk cache (`$FLUX_SHMEM_CACHE`, default ~/.cache/flux_shmem) that ops load from; without it, each
family is built on first use. Needs nvcc but no GPU.
"""
from __future__ import annotations

import argparse
import sys
import time

from .errors import BuildError
from .kernels import build as kb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flux_shmem.build", description=__doc__.splitlines()[0])
    p.add_argument("--family", action="append", help="kernel family (csrc/<family>.cu); default: all")
    p.add_argument("--arch", action="append", help="target arch such as 90a; default: $FLUX_SHMEM_ARCHS or 90a")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument("--list", action="store_true", help="print families and cache paths, build nothing")
    args = p.parse_args(argv)
    try:
        fams = args.family or kb.families()
        archs = tuple(args.arch) if args.arch else kb.archs_from_env()
        for fam in fams:
            for arch in archs:
                if args.list:
                    hit = kb.cached(fam, arch)
                    print(f"{fam:16s} sm_{arch:4s} {'cached ' + str(hit.cubin) if hit else 'not built'}")
                    continue
                t0 = time.time()
                art = kb.build(fam, arch, force=args.force)
                print(f"{fam:16s} sm_{arch:4s} {time.time() - t0:6.1f} s  {art.cubin}"
                      + (f"  {art.host_lib.name}" if art.host_lib else ""), flush=True)
    except BuildError as e:
        print(f"flux_shmem.build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
