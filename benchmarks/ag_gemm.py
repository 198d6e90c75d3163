#!/usr/bin/env python3
"""Benchmark only the AllGather+GEMM fused op: `benchmarks/run.py --ops ag_gemm`.

    flux-launch -n 8 benchmarks/ag_gemm.py [--quick] [run.py options]
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks.run import main as _run_main  # noqa: E402


def main(argv=None) -> int:
    """`run.py --ops ag_gemm [argv...]` (a later --ops in argv wins)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return _run_main(["--ops", "ag_gemm", *argv])


if __name__ == "__main__":
    sys.exit(main())
