#!/usr/bin/env bash
# One call on a GPU machine: install carried wheels, load prebuilt kernels (or build them), then run what is asked.
# Logs go to $OUT (the device tool's output folder) or ./.device_out.
#   bash benchmarks/gpu_session.sh [tests|bench|all] [extra pytest args...]
#   bash benchmarks/gpu_session.sh checks NP GROUP_OR_CHECK...
#   bash benchmarks/gpu_session.sh tune [benchmarks/gemm_tune.py args...]
#   bash benchmarks/gpu_session.sh shapes [benchmarks/gemm_shapes.py args...]
#   bash benchmarks/gpu_session.sh block NP [benchmarks/llama_block.py args...]
#   bash benchmarks/gpu_session.sh run NP [benchmarks/run.py args...]     (NP PEs; 1: no launcher)
#   bash benchmarks/gpu_session.sh mps <any of the above>
# `mps` first starts a CUDA MPS daemon (the GPU's compute mode and settings stay untouched) so that several PEs on
# one GPU run at once instead of time-slicing; each PE gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = MPS_TOTAL_PCT / NP
# (tests/test_gpu.py sets it per launch), or each PE gets a green context of its own SMs (the default in this
# mode) and MPS caps nothing; the daemon is stopped at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/.device_out}; mkdir -p "$OUT"
if [ "$what" = mps ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 && sleep 1  # a daemon left by an interrupted step
  nvidia-cuda-mps-control -d || exit 1
  trap 'echo quit | nvidia-cuda-mps-control; cat /tmp/mpslog/*.log >> "$OUT/mps.log" 2>/dev/null' EXIT
  trap 'exit 143' TERM INT
  export FLUX_SHMEM_TEST_MPS=1
  # Each PE in a green context of its own SMs (runtime/partition.py): without it, two PEs' persistent grids share
  # SMs and one runs at half speed (benchmarks/RESULTS.md, fourth session). FLUX_SHMEM_SM_PARTITION=none: MPS only.
  export FLUX_SHMEM_SM_PARTITION=${FLUX_SHMEM_SM_PARTITION:-green}
  what=${1:-all}; shift || true
  echo "MPS daemon started"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export FLUX_SHMEM_CACHE=${FLUX_SHMEM_CACHE:-$PWD/.cache/kernels}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FLUX_SHMEM_TIMEOUT_S=${FLUX_SHMEM_TIMEOUT_S:-60}
nvidia-smi -L; python3 -c "import torch, nvshmem; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
python3 -m flux_shmem.build --list --config all 2>&1 | tee "$OUT/build.log"  # carried kernels; missing ones build on first use
# A kernel missing from the carried cache would be built here, on device time (and fails where CUTLASS's headers
# are absent: a cache key names the CUTLASS version, so carry the nvidia-cutlass wheel with the cubins).
if grep -q "not built" "$OUT/build.log" && [ "${FLUX_SHMEM_ALLOW_BUILD:-0}" != 1 ]; then
  echo "gpu_session.sh: kernels missing from the carried cache (above); build them on the CPU machine" \
       "(python3 -m flux_shmem.build --config all with FLUX_SHMEM_CACHE=.cache/kernels), carry .cache and .whl" \
       "(nvshmem4py and nvidia-cutlass wheels), or set FLUX_SHMEM_ALLOW_BUILD=1" >&2
  exit 4
fi
# MPS_TOTAL_PCT (default 100): the share of the SMs all PEs together may use. MPS caps how many SMs a client holds,
# not which; less than 100 leaves slack between the PEs' persistent grids (tried with 90 on 2026-12-03: no better,
# benchmarks/RESULTS.md).
# With FLUX_SHMEM_SM_PARTITION=green each PE's green context says which SMs it uses, so MPS caps nothing (100).
mps_share() {
  [ -z "${FLUX_SHMEM_TEST_MPS:-}" ] && return 0
  if [ "${FLUX_SHMEM_SM_PARTITION:-none}" = green ]; then export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100
  else export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((${MPS_TOTAL_PCT:-100} / $1)); fi
}
rc=0
if [ "$what" = checks ]; then  # checks NP NAME...: named groups or checks of tests/gpu/checks.py under NP PEs
  np_=$1; shift
  ( mps_share "$np_"; python3 -m flux_shmem.launch -n "$np_" -- python3 tests/gpu/checks.py "$@" ) 2>&1 \
    | tee -a "$OUT/checks_np$np_.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = run ]; then  # run NP [run.py args]
  np_=$1; shift
  if [ "$np_" = 1 ]; then python3 benchmarks/run.py "$@"
  else ( mps_share "$np_"; python3 -m flux_shmem.launch -n "$np_" -- python3 benchmarks/run.py "$@" ); fi 2>&1 \
    | tee -a "$OUT/run_np$np_.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = tune ]; then  # tune [gemm_tune.py args]: GEMM configurations (built and carried) against cuBLAS
  python3 benchmarks/gemm_tune.py --jsonl "$OUT/tune.jsonl" "$@" 2>&1 | tee "$OUT/tune.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = shapes ]; then  # shapes [gemm_shapes.py args]: tp-shard suite, heuristic and tuned, vs cuBLAS
  python3 benchmarks/gemm_shapes.py --cache "$OUT/gemm_tune.json" --jsonl "$OUT/gemm_shapes.jsonl" "$@" 2>&1 \
    | tee "$OUT/gemm_shapes.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = block ]; then  # block NP [llama_block.py args]: the Llama TP block benchmark under NP PEs
  np_=$1; shift
  python3 -m flux_shmem.launch -n "$np_" -- python3 benchmarks/llama_block.py --jsonl "$OUT/block_np$np_.jsonl" "$@" \
    2>&1 | tee "$OUT/block_np$np_.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  export FLUX_SHMEM_TEST_LOGDIR=$OUT
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py "$@" 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # One GPU: our GEMM (gemm_only and the world-1 fused op) against cuBLAS on LLM shapes (target >= 0.95).
  python3 benchmarks/run.py --ops ag_gemm,gemm_rs --iters 20 --warmup 5 --no-progress \
    --shapes 8192x8192x8192,8192x28672x8192,16384x28672x8192,16384x8192x28672,8192x49152x12288,16384x12288x49152 \
    --jsonl "$OUT/bench_w1.jsonl" 2>&1 | tee "$OUT/bench_w1.log"
  # The README's main job: the quick overlap benchmark over every GPU (2 PEs share a GPU on a 1-GPU machine).
  n=$(python3 -c "import torch; print(max(2, torch.cuda.device_count()))")
  python3 -m flux_shmem.launch -n "$n" -- python3 benchmarks/run.py --quick --no-progress \
    --jsonl "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log"
fi
exit $rc
