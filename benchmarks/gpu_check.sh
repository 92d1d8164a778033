#!/usr/bin/env bash
# What the GPU path has to show, in one command, on a machine with a CUDA device:
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]      # default: bench_results/gpu_check
#
# Runs, in this order (tests first: a broken card path makes the figures meaningless):
#   gpu-tests         python -m pytest -m gpu: the engine, pdserve up, CUDA IPC, graphs, NVML
#   kernels           the Triton kernels compiled for the card against their references
#   attention-splits  copy bandwidth, then decode attention per split setting (1, auto,
#                     2x auto): the split kernel
#   bench-engine      pdserve bench-engine --device cuda, greedy and sampled, against
#                     transformers on the card, on a model of SmolLM2-135M's shapes with random
#                     weights (no model file reaches the GPU machine; the values don't change
#                     the speed)
#   served            pdserve bench, colocated and disaggregated (pdserve up: 1 prefill + 1
#                     decode worker, both on the card), greedy at c=64 on the same model and
#                     lengths as bench-engine; then served tok/s over bench-engine's at c=64
#                     (benchmarks/served_vs_engine.py): the host cost's goal on the card
#   kv-transfer       a 2,048-token prompt's KV over cuda_ipc and grpc, back to back and
#                     layer by layer
#   handoff-ops       the host time of each step of cuda_ipc's tail after the last layer
# Each step's full output goes to OUT_DIR/<step>.log and its tail to the terminal; a failing
# step is reported and the others still run. The exit status is 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench_results/gpu_check}
mkdir -p "$out"
failed=()

step() {
  local name=$1
  shift
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -v "it/s\]" "$out/$name.log" | tail -n 15
  if [ "$rc" -ne 0 ]; then
    echo "!! $name failed (exit $rc): $out/$name.log"
    failed+=("$name")
  fi
}

step gpu-tests python -m pytest -m gpu -q -rs -p no:cacheprovider
step kernels python -m pytest tests/kernels -q -rs -p no:cacheprovider
step attention-splits python benchmarks/bench_gpu.py --attention-only --out "$out/attention"
step random-smollm2 python -c "import sys; from pathlib import Path; \
from tests.tiny_model import SMOLLM2_SHAPE, write_tiny_llama; \
write_tiny_llama(Path(sys.argv[1]), **SMOLLM2_SHAPE)" "$out/smollm2-random"
step bench-engine python -m pdserve bench-engine --device cuda --model "$out/smollm2-random" \
  --concurrency 1 8 32 64 --sampling greedy temperature=1.0,top_p=0.95,top_k=50 \
  --out "$out/bench_engine"
step served python -m pdserve bench --model "$out/smollm2-random" --dtype bfloat16 \
  --backends colocated disagg --workload fixed --input-len 128 --output-len 128 \
  --num-prompts 256 --concurrency 64 --api completions --temperature 0 --out "$out/served"
step served-vs-engine python benchmarks/served_vs_engine.py "$out/bench_engine/results.json" \
  "$out/served" --concurrency 64
step kv-transfer python benchmarks/bench_kv_transfer.py --device cuda --kinds cuda_ipc grpc \
  --dtypes bfloat16 --prompt-tokens 2048 --runs 5 --compute-ms 2
step handoff-ops python benchmarks/bench_handoff_ops.py --device cuda

if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all steps passed; logs in $out"
