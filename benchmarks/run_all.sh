#!/usr/bin/env bash
# Check and time everything on a machine with a GPU, stage by stage:
#   bash benchmarks/run_all.sh STAGE...
# Models are random-weight folders of the real shapes, written once by transformers under $PEGAINFER_GPU_MODELS
# (default /tmp/models); MODELS=qwen3-4b,qwen3-8b picks the Qwen3 folders built up front (MODELS= builds none; the
# Qwen3.5 stages build their own). Logs and JSON go to $OUT (default ./gpu_out); the GPU accuracy tests append
# JSON lines to $OUT/gpu_results.jsonl. Record what matters in docs/perf/ (date, GPU, commit, command, numbers).
#
#   kernels   tests/kernels on the GPU
#   accuracy  the GPU tests (tests/gpu, tests/models -m gpu: full shapes against transformers, graph vs eager)
#   bench     pegainfer bench on $BENCH_MODELS (default qwen3-4b) with --hf, then the traced run's kernels
#   profile   step_profile.py kernels, timeline, ablation and gaps on $BENCH_MODELS; kernels and ablation of a
#             64-sequence step
#   micro     bench_gemv.py, bench_attention.py, bench_gated_delta.py, bench_row_kernels.py, bench_sampling.py,
#             launch_cost.py
#   cold      bench_gemv.py --cold on Qwen3-4B's shapes: the decode GEMV geometry sweep, $OUT/tuning_4b.json
#   skinny    the same at 16 tokens (the skinny prefill kernel), then bench with and without the swept geometries
#             (ab_policy.py --mode bench)
#   policy    ab_policy.py: the default launch policy against no PDL, PDL everywhere, no preloaded o, no LM-head
#             argmax, on Qwen3-4B's decode graph
#   trace     a traced generate and its per-kernel summary
#   floor     accuracy_floor.py on Qwen3-4B; floor35 the same on the Qwen3.5-4B shape
#   server    bench_server.py (HTTP vs in-process) on Qwen3-4B
#   start     cold (empty numba cache) and warm start of generate, process start to exit
#   bench35   Qwen3.5-4B in the multimodal checkpoint layout: TPOT with a traced run, then the 2048-token TTFT
#             beside Hugging Face (--hf)
#   acc35     tests/gpu/test_qwen35_gpu.py on that folder
#   serve     one `serve` of $SERVE_MODEL (default qwen3-4b, word-tokenizer view) and `bench-serve` against it at
#             each concurrency of $CONCURRENCY (default "1 64 256"), 128 tokens in / 256 out (after a shared
#             prefix of $PREFIX_LEN tokens if set; $SERVE_FLAGS go to serve, e.g. --enable-prefix-caching); then the
#             ShareGPT-like mix at the rates of $RATE (e.g. 10,20,40; default none: skipped), the highest with a
#             TTFT p99 within 500 ms named; then benchmarks/soak.py for $SOAK_S seconds
#             (default none) at 64 streams
#   batch     pegainfer bench --batch B (B in $BATCHES, default "64 256") at a 256-token context, beside the floor
#   attnbatch bench_attention.py --only batch: decode attention alone for $BATCHES sequences (default "64 256") at
#             a 256-token context, the default split-K block beside 4-warp blocks and warp pairs over the head dims
#   gdnbatch  bench_gated_delta.py --decode-batch: Qwen3.5-4B's fused Gated DeltaNet decode step alone for 1, 8, 64
#             and 256 sequences against its state floor
#   mixed     benchmarks/bench_mixed_step.py on Qwen3-4B: 64 decodes beside 16 arriving 128-token prompts, against
#             the decode step and the prompts alone
#   graphs    benchmarks/graph_capture.py on Qwen3-4B: the warm-up's graphs, what one more mixed-step capture costs,
#             replays of 8 / 16 / 32 chunk rows
#   prefix    benchmarks/prefix_cache_ttft.py on $PREFIX_MODEL (default qwen3-4b; qwen3.5-4b: the state snapshots):
#             a 2000-token shared prefix, cache on and off
#   constrained  benchmarks/constrained_decode.py on Qwen3-4B (a Qwen3-sized tokenizer view): unconstrained rows
#             beside JSON-schema rows at batch 8 and 64, and 64 JSON rows, against the unconstrained batches
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-/tmp/numba_cache}"
export PEGAINFER_GPU_MODELS="${PEGAINFER_GPU_MODELS:-/tmp/models}"
export PEGAINFER_GPU_RESULTS="$OUT/gpu_results.jsonl"
export PYTHONUNBUFFERED=1
M="$PEGAINFER_GPU_MODELS"
mkdir -p "$M"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/gpu.txt"
python3 - <<'PY' > "$OUT/models.log" 2>&1
import os, sys; sys.path.insert(0, os.getcwd())
from pathlib import Path
from tests.gpu.test_qwen3_gpu import SHAPES, make_random_qwen3
root = Path(os.environ["PEGAINFER_GPU_MODELS"])
for name in os.environ.get("MODELS", "qwen3-4b").split(","):
    if name: print(make_random_qwen3(root / name, SHAPES[name]))
PY
filter() { grep -v "Warning\|warn(\|falling back\|deprecated"; }
for stage in "$@"; do
  echo "=== stage $stage $(date +%T)"
  case "$stage" in
    kernels)  timeout ${KERNELS_TIMEOUT:-300} python3 -m pytest tests/kernels -q -x -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/kernels.log" ;;
    accuracy) timeout ${ACC_TIMEOUT:-400} python3 -m pytest tests/gpu tests/models -m gpu -q -s -p no:cacheprovider ${ACC_FILTER:-} 2>&1 \
                | filter | tail -40 | tee "$OUT/accuracy.log" ;;
    bench)    for m in ${BENCH_MODELS:-qwen3-4b}; do
                rm -rf "/tmp/trace_$m"
                timeout ${BENCH_TIMEOUT:-300} python3 -m pegainfer bench --model-path "$M/$m" --max-model-len 4096 \
                  --prompt-len 16 --output-len 128 --runs 5 ${BENCH_HF:---hf} --json "$OUT/bench_$m.json" \
                  --trace-output-path "/tmp/trace_$m" 2>&1 | filter | tail -25 | tee "$OUT/bench_$m.log"
                python3 benchmarks/step_profile.py trace /tmp/trace_$m/*.json 2>&1 | head -40 | tee -a "$OUT/bench_$m.log"
              done ;;
    profile)  for m in ${BENCH_MODELS:-qwen3-4b}; do
                for mode in kernels timeline ablation gaps; do
                  timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/step_profile.py $mode --model-path "$M/$m" \
                    --json "$OUT/${mode}_$m.json" 2>&1 | filter | tail -40 | tee "$OUT/${mode}_$m.log"
                done
                for mode in kernels ablation; do    # the same step for 64 sequences at a 256-token context
                  timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/step_profile.py $mode --model-path "$M/$m" \
                    --batch 64 --context 256 --json "$OUT/${mode}_b64_$m.json" 2>&1 | filter | tail -40 \
                    | tee "$OUT/${mode}_b64_$m.log"
                done
              done ;;
    micro)    for b in bench_gemv bench_attention bench_gated_delta bench_row_kernels bench_sampling launch_cost; do
                timeout ${MICRO_TIMEOUT:-200} python3 "benchmarks/$b.py" --json "$OUT/$b.json" 2>&1 | tail -30 | tee "$OUT/$b.log"
              done ;;
    cold)     timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/bench_gemv.py --cold --model 4b --tuning-out "$OUT/tuning_4b.json" \
                --json "$OUT/cold_4b.json" 2>&1 | filter | tail -60 | tee "$OUT/cold.log" ;;
    skinny)   timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/bench_gemv.py --cold --model 4b --tokens 16 \
                --tuning-out "$OUT/skinny16.json" --json "$OUT/skinny16_sweep.json" 2>&1 | filter | tail -60 | tee "$OUT/skinny.log"
              timeout ${AB_TIMEOUT:-600} python3 benchmarks/ab_policy.py --mode bench --model-path "$M/qwen3-4b" --rounds 2 \
                --variant base --variant "skinny16:tuning=$OUT/skinny16.json" --json "$OUT/skinny_ab.json" \
                -- --max-model-len 4096 --prompt-len 16 --output-len 32 --runs 5 2>&1 | tee -a "$OUT/skinny.log" ;;
    policy)   timeout ${AB_TIMEOUT:-600} python3 benchmarks/ab_policy.py --model-path "$M/qwen3-4b" --rounds 8 \
                --variant base --variant nopdl:pdl=none --variant allpdl:pdl=all --variant nopre:preload_o=false \
                --variant nohead:head_argmax=false --variant base2 --json "$OUT/policy.json" 2>&1 | filter | tail -20 \
                | tee "$OUT/policy.log" ;;
    trace)    rm -rf "$OUT/trace"
              timeout ${TRACE_TIMEOUT:-200} python3 -m pegainfer generate --model-path "$M/qwen3-4b" --max-model-len 4096 \
                --prompt "Hello there" --max-tokens 32 --temperature 0 --trace-output-path "$OUT/trace" 2>&1 | tail -4
              python3 benchmarks/step_profile.py trace "$OUT"/trace/*.json 2>&1 | tee "$OUT/trace_summary.log" ;;
    floor)    timeout ${FLOOR_TIMEOUT:-240} python3 benchmarks/accuracy_floor.py --model-path "$M/qwen3-4b" \
                --json "$OUT/floor.json" 2>&1 | filter | tail -12 | tee "$OUT/floor.log" ;;
    floor35)  timeout 60 python3 -c "
import sys, os; sys.path.insert(0, os.getcwd())
from pathlib import Path
from tests.models.test_qwen35_oracle import _write_random_qwen35_gpu, QWEN35_4B
print(_write_random_qwen35_gpu(Path('$M') / 'qwen3.5-4b-random', QWEN35_4B))" 2>&1 | tail -1
              timeout ${FLOOR_TIMEOUT:-240} python3 benchmarks/accuracy_floor.py --model-path "$M/qwen3.5-4b-random" \
                --json "$OUT/floor35.json" 2>&1 | filter | tail -8 | tee "$OUT/floor35.log" ;;
    server)   timeout ${SERVER_TIMEOUT:-300} python3 benchmarks/bench_server.py --model-path "$M/qwen3-4b" \
                --json "$OUT/server.json" 2>&1 | tail -8 | tee "$OUT/server.log" ;;
    start)    for kind in cold warm; do
                [ "$kind" = cold ] && rm -rf "$NUMBA_CACHE_DIR"
                s=$(date +%s.%N)
                timeout 300 python3 -m pegainfer generate --model-path "$M/qwen3-4b" --max-model-len 4096 \
                  --prompt "Hello" --max-tokens 16 --temperature 0 2>&1 | tail -3
                echo "$kind start (process start to exit, 16 tokens): $(echo "$(date +%s.%N) - $s" | bc) s" | tee -a "$OUT/start.log"
              done ;;
    bench35)  M35="$M/qwen3.5-4b-multimodal-random"
              timeout ${BUILD35_TIMEOUT:-240} python3 -c "
import os, sys; sys.path.insert(0, os.getcwd())
from pathlib import Path
from tests.gpu.test_qwen35_gpu import make_random_qwen35_multimodal
print('folder', make_random_qwen35_multimodal(Path('$M35')))" 2>&1 | tail -1 | tee "$OUT/bench35.log"
              rm -rf /tmp/trace35
              timeout ${BENCH_TIMEOUT:-300} python3 -m pegainfer bench --model-path "$M35" --max-model-len 4096 \
                --prompt-len 16 --output-len 128 --runs 5 --json "$OUT/bench35_decode.json" \
                --trace-output-path /tmp/trace35 2>&1 | tail -20 | tee -a "$OUT/bench35.log"
              python3 benchmarks/step_profile.py trace /tmp/trace35/*.json 2>&1 | head -40 | tee -a "$OUT/bench35.log"
              timeout ${BENCH_TIMEOUT:-300} python3 -m pegainfer bench --model-path "$M35" --max-model-len 4096 \
                --prompt-len 2048 --output-len 16 --runs 3 --hf --json "$OUT/bench35_ttft2048.json" 2>&1 \
                | filter | tail -26 | tee -a "$OUT/bench35.log" ;;
    acc35)    timeout ${ACC35_TIMEOUT:-300} python3 -m pytest tests/gpu/test_qwen35_gpu.py -m gpu -q -s -p no:cacheprovider \
                2>&1 | filter | tail -30 | tee "$OUT/acc35.log" ;;
    serve)    SM="$M/${SERVE_MODEL:-qwen3-4b}"
              VIEW=$(python3 -c "from pegainfer.serving_bench.word_tokenizer import word_tokenizer_view as v; \
print(v('$SM', '/tmp/serve_view'))" 2>/dev/null | tail -1)
              python3 -m pegainfer serve --model-path "$VIEW" --max-model-len 4096 --port 8123 --max-waiting 4096 \
                ${SERVE_FLAGS:-} > "$OUT/serve_server.log" 2>&1 &
              SERVER=$!
              for i in $(seq 1 ${SERVE_READY_S:-400}); do
                curl -sf http://127.0.0.1:8123/health > /dev/null && break; sleep 1; done
              echo "server ready after ${i}s" | tee "$OUT/serve.log"
              for c in ${CONCURRENCY:-1 64 256}; do
                n=$(( c < 16 ? 16 : 4 * c ))
                timeout ${SERVE_TIMEOUT:-180} python3 -m pegainfer bench-serve --base-url http://127.0.0.1:8123 \
                  --model-path "$VIEW" --num-prompts $n --max-concurrency $c --input-len 128 --output-len 256 \
                  ${PREFIX_LEN:+--prefix-len $PREFIX_LEN} --json "$OUT/serve_c$c.json" 2>&1 | filter | tail -30 | tee -a "$OUT/serve.log"
              done
              if [ -n "${RATE:-}" ]; then
                timeout ${SERVE_TIMEOUT:-180} python3 -m pegainfer bench-serve --base-url http://127.0.0.1:8123 \
                  --model-path "$VIEW" --num-prompts 512 --request-rate $RATE --dataset-name sharegpt \
                  --goal-ttft-p99-ms 500 --json "$OUT/serve_sharegpt.json" 2>&1 | filter | tail -40 \
                  | tee -a "$OUT/serve.log"
              fi
              if [ -n "${SOAK_S:-}" ]; then
                timeout $(( SOAK_S + 120 )) python3 benchmarks/soak.py --url http://127.0.0.1:8123 --server-pid $SERVER \
                  --duration $SOAK_S --concurrency 64 --json "$OUT/soak.json" 2>&1 | filter | tail -25 \
                  | tee -a "$OUT/serve.log"
              fi
              curl -s http://127.0.0.1:8123/metrics 2>/dev/null | grep -v "^#" | grep -i "preempt\|prefix\|kv\|running\|waiting" \
                | head -20 | tee -a "$OUT/serve.log"
              kill -INT $SERVER; wait $SERVER
              tail -5 "$OUT/serve_server.log" ;;
    batch)    for b in ${BATCHES:-64 256}; do
                timeout ${BENCH_TIMEOUT:-300} python3 -m pegainfer bench --model-path "$M/${SERVE_MODEL:-qwen3-4b}" \
                  --batch $b --prompt-len 256 --output-len 32 --runs 3 --json "$OUT/batch_$b.json" 2>&1 | filter \
                  | tail -12 | tee -a "$OUT/batch.log"
              done ;;
    attnbatch) for b in ${BATCHES:-64 256}; do
                timeout ${MICRO_TIMEOUT:-200} python3 benchmarks/bench_attention.py --only batch --batch $b \
                  --decode-geometry 4,0 --decode-geometry 16,1 --decode-geometry 8,1 --json "$OUT/attn_batch_$b.json" \
                  2>&1 | filter | tail -8 | tee -a "$OUT/attn_batch.log"
              done ;;
    gdnbatch) timeout ${MICRO_TIMEOUT:-200} python3 benchmarks/bench_gated_delta.py --decode-batch 1,8,64,256 \
                --json "$OUT/gdn_batch.json" 2>&1 | filter | tail -8 | tee "$OUT/gdn_batch.log" ;;
    mixed)    timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_mixed_step.py --model-path "$M/qwen3-4b" \
                --batch 64 --prompts 16 --prompt-len 128 --runs 5 --json "$OUT/mixed_step.json" 2>&1 | filter \
                | tail -8 | tee "$OUT/mixed_step.log" ;;
    graphs)   timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/graph_capture.py --model-path "$M/qwen3-4b" \
                --max-batch 64 --json "$OUT/graph_capture.json" 2>&1 | filter | tail -20 | tee "$OUT/graph_capture.log" ;;
    prefix)   timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/prefix_cache_ttft.py --model-path "$M/${PREFIX_MODEL:-qwen3-4b}" \
                --prefix-len 2000 --suffix-len 16 --runs 3 --followers 2 --json "$OUT/prefix.json" 2>&1 | filter | tail -6 \
                | tee "$OUT/prefix.log" ;;
    constrained) timeout ${BUILD_TIMEOUT:-200} python3 -c "
import os, sys; sys.path.insert(0, os.getcwd())
from pathlib import Path
from tests.gpu.test_qwen3_gpu import SHAPES, make_random_qwen3
print(make_random_qwen3(Path('$M') / 'qwen3-4b', SHAPES['qwen3-4b']))" 2>&1 | tail -1
              timeout ${CONSTRAINED_TIMEOUT:-200} python3 benchmarks/constrained_decode.py --model-path "$M/qwen3-4b" \
                --qwen3-vocab --json "$OUT/constrained.json" 2>&1 | filter | tail -20 | tee "$OUT/constrained.log" ;;
    *)        echo "unknown stage $stage (see the list at the top of $0)" ;;
  esac
done
echo "=== done $(date +%T)"
