#!/usr/bin/env bash
# One device call that checks and times everything on the GPU host. Usage (through the device tool, carrying .whl):
#   source .whl/prelude.sh; bash benchmarks/gpu_session.sh STAGE...
# Stages: kernels accuracy bench profile micro trace floor floor35 server start bench35 acc35 skinny (MODELS= skips building the
# Qwen3-4B folder that the Qwen3 stages need; the Qwen3.5 stages build their own). Logs and JSON land in $OUT (or
# ./gpu_out); accuracy tests append JSON lines to $OUT/gpu_results.jsonl.
#   bench35: Qwen3.5-4B shape in the multimodal checkpoint layout (random weights, built once by transformers):
#            batch-1 TPOT with CUDA graphs vs the floor (16-token prompt, 128 tokens, one traced run + per-kernel
#            summary), then TTFT of a 2048-token prompt beside Hugging Face on the same weights (--hf).
#   acc35:   tests/gpu/test_qwen35_gpu.py on that folder (256-token prompt + 64 decode steps vs HF bf16 / fp32).
#   skinny:  sweep the skinny prefill kernel's geometries at 16 tokens on cold weights (bench_decode_stream.py
#            --tokens 16, Qwen3-4B shapes), then TTFT / TPOT with the defaults and with the swept best
#            (PEGAINFER_GEMV_TUNING=$OUT/skinny16.json), alternating, two runs each.
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-/tmp/numba_cache}"
export PEGAINFER_GPU_MODELS="${PEGAINFER_GPU_MODELS:-/tmp/models}"
export PEGAINFER_GPU_RESULTS="$OUT/gpu_results.jsonl"
export PYTHONUNBUFFERED=1
mkdir -p "$PEGAINFER_GPU_MODELS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/gpu.txt"
python3 - <<'PY' > "$OUT/models.log" 2>&1
import os, sys; sys.path.insert(0, os.getcwd())
from pathlib import Path
from tests.gpu.test_qwen3_gpu import SHAPES, make_random_qwen3
root = Path(os.environ["PEGAINFER_GPU_MODELS"])
for stage in os.environ.get("MODELS", "qwen3-4b").split(","):
    if stage: print(make_random_qwen3(root / stage, SHAPES[stage]))
PY
for stage in "$@"; do
  echo "=== stage $stage $(date +%T)"
  case "$stage" in
    kernels)  timeout ${KERNELS_TIMEOUT:-300} python3 -m pytest tests/kernels -q -x -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/kernels.log" ;;
    accuracy) timeout ${ACC_TIMEOUT:-400} python3 -m pytest tests/gpu tests/models -m gpu -q -s -p no:cacheprovider ${ACC_FILTER:-} 2>&1 \
                | grep -v "Warning\|warn(" | tail -40 | tee "$OUT/accuracy.log" ;;
    bench)    for m in ${BENCH_MODELS:-qwen3-4b}; do
                timeout ${BENCH_TIMEOUT:-300} python3 -m pegainfer bench --model-path "$PEGAINFER_GPU_MODELS/$m" --max-model-len 4096 \
                  --prompt-len 16 --output-len 128 --runs 5 ${BENCH_HF:---hf} --json "$OUT/bench_$m.json" \
                  --trace-output-path /tmp/trace_$m 2>&1 | tail -25 | tee "$OUT/bench_$m.log"
                python3 benchmarks/trace_summary.py /tmp/trace_$m/*.json 2>&1 | head -40 | tee -a "$OUT/bench_$m.log"
              done ;;
    profile)  for m in ${BENCH_MODELS:-qwen3-4b}; do
                timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/profile_step.py --model-path "$PEGAINFER_GPU_MODELS/$m" \
                  --context 128 --steps 20 2>&1 | grep -v "Warn\|warn(" | tail -40 | tee "$OUT/profile_$m.log"
              done ;;
    micro)    for b in benchmarks/bench_gemv.py benchmarks/bench_attention.py benchmarks/bench_sampling.py; do
                [ -f "$b" ] && timeout ${MICRO_TIMEOUT:-200} python3 "$b" --json "$OUT/$(basename "$b" .py).json" 2>&1 | tail -30 | tee "$OUT/$(basename "$b" .py).log"
              done ;;
    trace)    timeout ${TRACE_TIMEOUT:-200} python3 -m pegainfer generate --model-path "$PEGAINFER_GPU_MODELS/qwen3-4b" --max-model-len 4096 \
                --prompt "Hello there" --max-tokens 32 --temperature 0 --trace-output-path "$OUT/trace" 2>&1 | tail -4
              python3 benchmarks/trace_summary.py "$OUT"/trace/*.json 2>&1 | tee "$OUT/trace_summary.log" ;;
    floor35)  timeout 60 python3 -c "
import sys, os; sys.path.insert(0, os.getcwd())
from pathlib import Path
from tests.models.test_qwen35_oracle import _write_random_qwen35_gpu, QWEN35_4B
print(_write_random_qwen35_gpu(Path(os.environ['PEGAINFER_GPU_MODELS']) / 'qwen3.5-4b-random', QWEN35_4B))" 2>&1 | tail -1
              timeout ${FLOOR_TIMEOUT:-240} python3 benchmarks/accuracy_floor.py --model-path "$PEGAINFER_GPU_MODELS/qwen3.5-4b-random" \
                --json "$OUT/floor35.json" 2>&1 | grep -v Warning | tail -8 | tee "$OUT/floor35.log" ;;
    floor)    timeout ${FLOOR_TIMEOUT:-240} python3 benchmarks/accuracy_floor.py --model-path "$PEGAINFER_GPU_MODELS/qwen3-4b" \
                --json "$OUT/floor.json" 2>&1 | grep -v Warning | tail -12 | tee "$OUT/floor.log" ;;
    server)   timeout ${SERVER_TIMEOUT:-300} python3 benchmarks/bench_server.py --model-path "$PEGAINFER_GPU_MODELS/qwen3-4b" \
                --json "$OUT/server.json" 2>&1 | tail -8 | tee "$OUT/server.log" ;;
    start)    for kind in cold warm; do
                [ "$kind" = cold ] && rm -rf "$NUMBA_CACHE_DIR"
                s=$(date +%s.%N)
                timeout 300 python3 -m pegainfer generate --model-path "$PEGAINFER_GPU_MODELS/qwen3-4b" --max-model-len 4096 \
                  --prompt "Hello" --max-tokens 16 --temperature 0 2>&1 | tail -3
                echo "$kind start (process start to exit, 16 tokens): $(echo "$(date +%s.%N) - $s" | bc) s" | tee -a "$OUT/start.log"
              done ;;
    bench35)  M35="$PEGAINFER_GPU_MODELS/qwen3.5-4b-multimodal-random"
              timeout ${BUILD35_TIMEOUT:-240} python3 -c "
import os, sys; sys.path.insert(0, os.getcwd())
from pathlib import Path
from tests.gpu.test_qwen35_gpu import make_random_qwen35_multimodal
print('folder', make_random_qwen35_multimodal(Path('$M35')))" 2>&1 | tail -1 | tee "$OUT/bench35.log"
              timeout ${BENCH_TIMEOUT:-300} python3 -m pegainfer bench --model-path "$M35" --max-model-len 4096 \
                --prompt-len 16 --output-len 128 --runs 5 --json "$OUT/bench35_decode.json" \
                --trace-output-path /tmp/trace35 2>&1 | tail -20 | tee -a "$OUT/bench35.log"
              python3 benchmarks/trace_summary.py /tmp/trace35/*.json 2>&1 | head -40 | tee -a "$OUT/bench35.log"
              timeout ${BENCH_TIMEOUT:-300} python3 -m pegainfer bench --model-path "$M35" --max-model-len 4096 \
                --prompt-len 2048 --output-len 16 --runs 3 --hf --json "$OUT/bench35_ttft2048.json" 2>&1 \
                | grep -v "Warning\|warn(\|falling back\|deprecated" | tail -26 | tee -a "$OUT/bench35.log" ;;
    skinny)   (cd benchmarks && timeout ${SWEEP_TIMEOUT:-300} python3 bench_decode_stream.py --model 4b --tokens 16 \
                --tuning-out "$OUT/skinny16.json" --json "$OUT/skinny16_sweep.json" 2>&1 | grep -v "Warn\|warn(" \
                | grep -A4 "^qkv\|^o \|^gate_up\|^down\|SKINNY\|one graph\|default \|best " | tee "$OUT/skinny.log")
              for run in 1 2; do for tuning in "" "$OUT/skinny16.json"; do
                echo "--- tuning=${tuning:-defaults}" | tee -a "$OUT/skinny.log"
                PEGAINFER_GEMV_TUNING="$tuning" timeout ${BENCH_TIMEOUT:-300} python3 -m pegainfer bench \
                  --model-path "$PEGAINFER_GPU_MODELS/qwen3-4b" --max-model-len 4096 --prompt-len 16 --output-len 32 \
                  --runs 5 2>&1 | grep "ttft_ms\|tpot_ms" | tee -a "$OUT/skinny.log"
              done; done ;;
    acc35)    timeout ${ACC35_TIMEOUT:-300} python3 -m pytest tests/gpu/test_qwen35_gpu.py -m gpu -q -s -p no:cacheprovider \
                2>&1 | grep -v "Warning\|warn(\|falling back\|deprecated" | tail -30 | tee "$OUT/acc35.log" ;;
  esac
done
echo "=== done $(date +%T)"
