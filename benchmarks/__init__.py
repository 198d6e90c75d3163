"""Overlap benchmark suite for flux_shmem.

Pure helpers (importable without a GPU): :mod:`benchmarks.metrics`,
:mod:`benchmarks.model`, :mod:`benchmarks.report`, :mod:`benchmarks.shapes`.
GPU-only code (imported lazily by ``run.py`` once a CUDA device is known to be
visible): :mod:`benchmarks.timing`, :mod:`benchmarks.baselines`,
:mod:`benchmarks.suite`.

Entry points: ``benchmarks/run.py`` (all ops), ``benchmarks/ag_gemm.py`` and
``benchmarks/gemm_rs.py`` (one fused op each), ``benchmarks/llama_block.py``
(a Llama-3-70B TP block on flux_shmem.nn; ``run.py --ops block``).
"""
