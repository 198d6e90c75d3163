#!/usr/bin/env bash
# Verification steps for one device call, each bounded in time, all logs packed into $OUT/steps_logs.tgz. The
# overlap steps run several PEs at once under CUDA MPS, each on its share of the SMs, links emulated
# (benchmarks/run.py --emulate-link).
#   bash benchmarks/device_steps.sh STEP...
# steps:
#   check1          GPU checks with 1 PE (no MPS): runtime, collectives, gemm, hazards
#   check2 / check4 GPU checks with 2 / 4 PEs under MPS: collectives, gemm, hazards, emulation
#   conc2           whether 2 PEs under MPS run at once on separate SMs (a GEMM alone vs both at once)
#   soak2 / soak4   2,000 back-to-back fused calls per op under MPS
#   put2            the gemm checks with 2 PEs, every peer through NVSHMEM put (FLUX_SHMEM_FORCE_PUT)
#   two4            collectives + gemm checks with 4 PEs as 2 "nodes" of 2 (FLUX_SHMEM_NODE_SIZE=2) under MPS
#   large12         the reduce over a node of 12 PEs under MPS
#   shapes          issue 11's tp-shard-quick GEMM suite (heuristic and tuned vs cuBLAS), bounded to 270 s;
#                   SHAPES_SUITE=tp-shard SHAPES_PART=I/N runs part I of N of the whole suite (merge the parts'
#                   gemm_shapes.jsonl with `python3 benchmarks/gemm_shapes.py --summarize FILE...`); SHAPES_TUNE=none
#                   skips tuning (heuristic rows only, where the cache lacks a shape)
#   pdl             the tp-shard-quick suite (heuristic only) without, then with FLUX_SHMEM_GEMM_PDL=1 (half the step each)
#   emu2 / emu4     emulated-NVLink overlap benchmark of both fused ops with 2 / 4 PEs (TP8-like shard shapes)
#   emuput2         the same with 2 PEs and forced puts
#   fp8emu2 / fp8emu4  GEMM+RS of emu2 / emu4 with e4m3 operands (run.py --dtype fp8; baseline torch._scaled_mm + NCCL)
#   evict2 / evict4 GEMM+RS of emu2 / emu4 with the reduce kernel's L2 evict-first policy (FLUX_SHMEM_RS_EVICT_FIRST=1)
#   sleep2 / sleep4 the same with the reduce kernel's tile waits sleeping between polls (FLUX_SHMEM_RS_POLL_SLEEP=1)
#   nn1 / nn2       the flux_shmem.nn checks (layers, Llama block, torch.compile, CUDA-graph step) with 1 / 2 PEs
#   nnput2          nn checks with 2 PEs and forced puts
#   torchrun        nn checks + a fixed step under torchrun --nproc-per-node 2, compared with flux-launch -n 2 (MPS)
#   block2          benchmarks/llama_block.py --quick with 2 PEs (correctness, overheads)
#   gemmgpu         the GEMM kernel tests of every configuration (tests/test_gemm_kernels_gpu.py)
#   skalign         stream-K tails (128x256, split 2) unaligned and aligned to 2 and 4 K chunks (tail_chunks) against
#                   cuBLAS on tail-heavy tp-shard shapes (SK_SHAPES), cuBLAS's own kernel recorded; a third of the
#                   step each
#   fp8gpu          the fp8 GEMM tests (tests/test_fp8_gpu.py)
#   sweep2          issue 25 with 2 PEs under MPS: 50 distinct M per op checked, graphs after prepare(), small-M
#                   auto vs fused / decomposed / cuBLAS + our collective, host time per call
#   fp8ops1 / fp8ops2 / fp8put2  the fp8 fused-op checks (group fp8) with 1 PE, 2 PEs under MPS, 2 PEs forced puts
#   table           our plain GEMMs (heuristic) against cuBLAS over the tp-shard-small suite (M 64-512), then the whole
#                   tp-shard suite, both layouts, 2/5 and 3/5 of the step: the records behind the plain-GEMM backend
#                   table (issue 36), in $OUT/table_<suite>.jsonl
#   records         our plain GEMMs against cuBLAS in green contexts of 2 and 4 equal groups of the SMs (the SM
#                   budgets of autosweep2/4's PEs) on autosweep's shard shapes, M 64-16384 (half the step each),
#                   merged into $OUT/records_green.json, which FLUX_SHMEM_GEMM_RECORDS then names for later steps
#   gpucheck1 / gpucheck2  the gemm and fp8 check groups with 1 / 2 PEs (2: under MPS), FLUX_SHMEM_CHECK_PLANS=1;
#                   gpucheckours2 the gemm group with FLUX_SHMEM_PLAIN_GEMM=ours (cuBLAS is the default backend)
#   autosweep2 / autosweep4  issue 36 with 2 / 4 PEs under MPS, links emulated (NVLink's 360 GB/s x the PE's SM
#                   share): mode 'auto' against fused, decomposed and cuBLAS + our collective, M 64-16384 on six shard
#                   shapes; fails where auto is more than 5% slower than the best
#   moe1 / moe2 / moe4 / moeput2  the MoE op checks (group moe: issue 38) with 1 PE, 2 / 4 PEs under MPS, 2 PEs
#                   forced puts
#   moebench2 / moebench4  benchmarks/moe.py with 2 / 4 PEs under MPS, links emulated as autosweep's: decomposed vs
#                   pipelined per op and block, Mixtral-8x7B and Qwen3-30B-A3B shards, M = MOE_TOKENS (8192)
#   fp8shapes       benchmarks/gemm_fp8.py over FP8_SUITE (default tp-shard-quick; FP8_PART=I/N, FP8_SCALES,
#                   FP8_FAMILY default both) vs torch._scaled_mm, records in $OUT/gemm_fp8.jsonl
# Each step is bounded by STEP_TIMEOUT seconds (default 240; STEP:SECONDS for one step) and the next one runs
# whatever happened.
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/.device_out}; mkdir -p "$FINAL"
export OUT=/tmp/steps_logs; rm -rf "$OUT"; mkdir -p "$OUT"  # everything, packed into one file at the end
S=benchmarks/gpu_session.sh
# Per-GPU GEMMs like Llama-3-70B at TP8 (up 8192x3584x8192, QKV 8192x1280x8192, down 8192x8192x3584), as global
# shapes for W PEs (AG splits N, RS splits K), and M = 4096 variants.
ag_shapes() { local w=$1; echo "8192x$((3584 * w))x8192,4096x$((3584 * w))x8192,8192x$((1280 * w))x8192"; }
rs_shapes() { local w=$1; echo "8192x8192x$((3584 * w)),4096x8192x$((3584 * w)),8192x8192x$((1024 * w))"; }
site() {  # the carried wheels on the path, the carried kernel cache in use (one-process steps without gpu_session.sh)
  echo "export FLUX_SHMEM_CACHE=$PWD/.cache/kernels; ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q \
--no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD;"
}
emu() {  # emu NP [extra run.py args]; EMU_OPS="gemm_rs" (say) runs one op only, EMU_TAG names its logs,
  # EMU_AG_SHAPES / EMU_RS_SHAPES replace the op's shapes
  local np_=$1; shift
  local tag=${EMU_TAG:-}$*
  if [[ " ${EMU_OPS:-ag_gemm gemm_rs} " == *" ag_gemm "* ]]; then
    timeout "$T" bash $S mps run "$np_" --emulate-link nvlink --mode fused --ops ag_gemm --shapes "${EMU_AG_SHAPES:-$(ag_shapes "$np_")}" \
      --iters 30 --warmup 5 --no-progress --jsonl "$OUT/emu${np_}_ag${tag}.jsonl" "$@" | tail -25
  fi
  if [[ " ${EMU_OPS:-ag_gemm gemm_rs} " == *" gemm_rs "* ]]; then
    timeout "$T" bash $S mps run "$np_" --emulate-link nvlink --mode fused --ops gemm_rs --shapes "${EMU_RS_SHAPES:-$(rs_shapes "$np_")}" \
      --iters 30 --warmup 5 --no-progress --jsonl "$OUT/emu${np_}_rs${tag}.jsonl" "$@" | tail -25
  fi
}
for spec in "$@"; do
  step=${spec%%:*}; T=${STEP_TIMEOUT:-240}; [ "$spec" != "$step" ] && T=${spec#*:}
  echo "===== $step (${T} s) $(date +%T)"
  case $step in
    check1) timeout "$T" bash $S checks 1 runtime collectives gemm hazards | grep -E "CHECK|Error|error" ;;
    check2) timeout "$T" bash $S mps checks 2 collectives gemm hazards emulation | grep -E "CHECK|Error|error|assert" ;;
    conc2) timeout "$T" bash $S mps checks 2 mps_concurrency | grep -E "CHECK|Error|error|assert" ;;
    check4) timeout "$T" bash $S mps checks 4 collectives gemm hazards | grep -E "CHECK|Error|error|assert" ;;
    soak2) FLUX_SHMEM_SOAK_CALLS=2000 timeout "$T" bash $S mps checks 2 soak | grep -E "CHECK|Error|error|assert" ;;
    soak4) FLUX_SHMEM_SOAK_CALLS=2000 timeout "$T" bash $S mps checks 4 soak | grep -E "CHECK|Error|error|assert" ;;
    put2) FLUX_SHMEM_FORCE_PUT=1 timeout "$T" bash $S mps checks 2 gemm | grep -E "CHECK|Error|error|assert" ;;
    two4) FLUX_SHMEM_NODE_SIZE=2 timeout "$T" bash $S mps checks 4 collectives gemm | grep -E "CHECK|Error|error|assert" ;;
    large12) timeout "$T" bash $S mps checks 12 large_node_reduce | grep -E "CHECK|Error|error|assert" ;;
    shapes) timeout "$T" bash $S shapes --suite "${SHAPES_SUITE:-tp-shard-quick}" ${SHAPES_PART:+--part "$SHAPES_PART"} \
      ${SHAPES_TUNE:+--tune "$SHAPES_TUNE"} \
      --budget-s $((T - 30)) | tail -40 ;;
    pdl) for v in 0 1; do FLUX_SHMEM_GEMM_PDL=$v timeout $((T / 2)) bash $S shapes --suite tp-shard-quick --tune none \
      --fused-shapes '' --budget-s $((T / 2 - 30)) --jsonl "$OUT/gemm_shapes_pdl$v.jsonl" | tail -8; done ;;
    gemmgpu) timeout "$T" bash -c "export FLUX_SHMEM_CACHE=$PWD/.cache/kernels; ls .whl/*.whl >/dev/null 2>&1 && \
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site:$PWD \
      python3 -m pytest -q -p no:cacheprovider tests/test_gemm_kernels_gpu.py" 2>&1 | tail -15 ;;
    skalign) for q in 0 2 4; do echo "--- chunks=$q"; FLUX_SHMEM_GEMM_CONFIG=config=128x256_c2x1,split=2,chunks=$q \
      timeout $((T / 3)) bash $S shapes --shapes "${SK_SHAPES:-4096x1280x8192,1024x7392x8192,2048x3584x8192,4096x1536x4096,8192x1280x8192,1024x4608x12288,4096x1792x4096,1024x6656x16384}" \
      --layouts nk --families gemm_rs --tune none --fused-shapes '' --rounds 3 $([ $q = 0 ] && echo --cublas-kernels) \
      --jsonl "$OUT/gemm_shapes_q$q.jsonl" | tail -12; done ;;
    table) timeout $((T * 2 / 5)) bash $S shapes --suite tp-shard-small --tune none --fused-shapes '' --rounds 4 \
      --budget-s $((T * 2 / 5 - 15)) --jsonl "$OUT/table_tp-shard-small.jsonl" | tail -6
      timeout $((T * 3 / 5)) bash $S shapes --suite tp-shard --tune none --fused-shapes '' --rounds 4 \
      --budget-s $((T * 3 / 5 - 15)) --jsonl "$OUT/table_tp-shard.jsonl" | tail -6 ;;
    records) for g in 2 4; do timeout $((T / 2)) bash $S shapes --green $g --shapes "$(python3 -c "
ms = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
nk = ((3584, 8192), (1280, 8192), (1792, 4096), (8192, 3584), (8192, 1024), (4096, 1792))
print(','.join(f'{m}x{n}x{k}' for n, k in nk for m in ms))")" --layouts nk --tune none --fused-shapes '' --rounds 4 \
      --jsonl "$OUT/records_g$g.jsonl" | tail -6; done
      python3 benchmarks/gemm_records.py "$OUT"/records_g*.jsonl --out "$OUT/records_green.json" && \
        export FLUX_SHMEM_GEMM_RECORDS="$OUT/records_green.json" ;;
    gpucheck1) FLUX_SHMEM_CHECK_PLANS=1 timeout "$T" bash $S checks 1 gemm fp8 | grep -E "CHECK|Error|error|assert"
      echo "exit status ${PIPESTATUS[0]}" ;;
    gpucheck2) FLUX_SHMEM_CHECK_PLANS=1 timeout "$T" bash $S mps checks 2 gemm fp8 | grep -E "CHECK|Error|error|assert"
      echo "exit status ${PIPESTATUS[0]}" ;;
    gpucheckours2) FLUX_SHMEM_PLAIN_GEMM=ours FLUX_SHMEM_CHECK_PLANS=1 timeout "$T" bash $S mps checks 2 gemm \
      | grep -E "CHECK|Error|error|assert"; echo "exit status ${PIPESTATUS[0]}" ;;
    autosweep2) FLUX_SHMEM_LINK_GBPS=174.545 NVSHMEM_SYMMETRIC_SIZE=6G timeout "$T" bash $S mps checks 2 autosweep \
      | grep -E "CHECK|Error|error|assert"; echo "exit status ${PIPESTATUS[0]}" ;;
    autosweep4) FLUX_SHMEM_LINK_GBPS=87.273 NVSHMEM_SYMMETRIC_SIZE=6G timeout "$T" bash $S mps checks 4 autosweep \
      | grep -E "CHECK|Error|error|assert"; echo "exit status ${PIPESTATUS[0]}" ;;
    sweep2) timeout "$T" bash $S mps checks 2 sweep | grep -E "CHECK|Error|error|assert" ;;
    moe1) timeout "$T" bash $S checks 1 moe | grep -E "CHECK|Error|error|assert"; echo "exit status ${PIPESTATUS[0]}" ;;
    moe2) timeout "$T" bash $S mps checks 2 moe | grep -E "CHECK|Error|error|assert"; echo "exit status ${PIPESTATUS[0]}" ;;
    moe4) timeout "$T" bash $S mps checks 4 moe | grep -E "CHECK|Error|error|assert"; echo "exit status ${PIPESTATUS[0]}" ;;
    moeput2) FLUX_SHMEM_FORCE_PUT=1 timeout "$T" bash $S mps checks 2 moe | grep -E "CHECK|Error|error|assert"
      echo "exit status ${PIPESTATUS[0]}" ;;
    moebench2) FLUX_SHMEM_LINK_GBPS=174.545 timeout "$T" bash $S mps run 2 --ops moe \
      --models mixtral-8x7b,qwen3-30b-a3b --tokens "${MOE_TOKENS:-8192}" --iters 20 --warmup 3 --jsonl "$OUT/moe2.jsonl" \
      | grep -E "^moe|^#|Error|error|FAILED" ;;
    moebench4) FLUX_SHMEM_LINK_GBPS=87.273 timeout "$T" bash $S mps run 4 --ops moe \
      --models mixtral-8x7b,qwen3-30b-a3b --tokens "${MOE_TOKENS:-8192}" --iters 20 --warmup 3 --jsonl "$OUT/moe4.jsonl" \
      | grep -E "^moe|^#|Error|error|FAILED" ;;
    fp8ops1) timeout "$T" bash $S checks 1 fp8 | grep -E "CHECK|Error|error|assert" ;;
    fp8ops2) timeout "$T" bash $S mps checks 2 fp8 | grep -E "CHECK|Error|error|assert" ;;
    fp8put2) FLUX_SHMEM_FORCE_PUT=1 timeout "$T" bash $S mps checks 2 fp8 | grep -E "CHECK|Error|error|assert" ;;
    fp8gpu) timeout "$T" bash -c "$(site) python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py" 2>&1 | tail -25 ;;
    fp8shapes) timeout "$T" bash -c "$(site) python3 benchmarks/gemm_fp8.py --suite ${FP8_SUITE:-tp-shard-quick} \
      --part ${FP8_PART:-1/1} --scales ${FP8_SCALES:-tensor} --family ${FP8_FAMILY:-both} --rounds 3 \
      --budget-s $((T - 20)) --jsonl $OUT/gemm_fp8.jsonl" 2>&1 | tail -${FP8_TAIL:-12} ;;
    emu2) emu 2 ;;
    emu4) emu 4 ;;
    evict2) FLUX_SHMEM_RS_EVICT_FIRST=1 EMU_OPS=gemm_rs EMU_TAG=_evict emu 2 ;;
    evict4) FLUX_SHMEM_RS_EVICT_FIRST=1 EMU_OPS=gemm_rs EMU_TAG=_evict emu 4 ;;
    sleep2) FLUX_SHMEM_RS_POLL_SLEEP=1 EMU_OPS=gemm_rs EMU_TAG=_sleep emu 2 ;;
    sleep4) FLUX_SHMEM_RS_POLL_SLEEP=1 EMU_OPS=gemm_rs EMU_TAG=_sleep emu 4 ;;
    emuput2) emu 2 --force-put ;;
    fp8emu2) EMU_OPS=gemm_rs emu 2 --dtype fp8 ;;
    fp8emu4) EMU_OPS=gemm_rs emu 4 --dtype fp8 ;;
    nn1) timeout "$T" bash $S checks 1 nn | grep -E "CHECK|Error|error|assert" ;;
    nn2) timeout "$T" bash $S mps checks 2 nn | grep -E "CHECK|Error|error|assert" ;;
    nnput2) FLUX_SHMEM_FORCE_PUT=1 timeout "$T" bash $S mps checks 2 nn | grep -E "CHECK|Error|error|assert" ;;
    torchrun) timeout "$T" bash $S mps tests -k torchrun | tail -30 ;;  # (time-sliced, it outlasted 70 s)
    block2) timeout "$T" bash $S block 2 --quick | tail -30 ;;
    *) echo "unknown step $step" ;;
  esac
  tar czf "$FINAL/steps_logs.tgz" -C "$OUT" . 2>/dev/null  # after every step: a call cut short keeps its logs
done
echo "===== done $(date +%T)"
tar czf "$FINAL/steps_logs.tgz" -C "$OUT" . && ls -la "$OUT"
