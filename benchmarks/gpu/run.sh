#!/bin/bash
# Issue 46's whole table on a lent GPU machine, in about 8 device-minutes: the device tool's `run` with carry
# [".gpu", ".whl"] after benchmarks/gpu/prepare.sh. The steps' timeouts add up to 640 s (the tool's limit is 600 s a
# call, the machine's start not included): two calls, `... run.sh warm8k warm32k` (340 s) and
# `... run.sh fresh coder tests` (300 s), each with OUT set apart or the second's log appended to the first's.
#
#   bash benchmarks/gpu/run.sh [--dry-run] [STEP ...]     STEP: warm8k warm32k fresh coder tests (default: these, in this
#                                                         order), groups (the transform-group A/B, 80 s) or batch (the
#                                                         engine's decode step beside plain transformers', then many users
#                                                         at once on 8K contexts, issue 53's GPU rows, 390 s; batch-calls:
#                                                         the same without the decode kernel, a call per request): asked alone
#
# A 7B-shaped bf16 Llama (random weights: timing only) at 7,680 and 30,720 tokens: recompute (text), fp16 naive over
# the store, the hardware's floor (fp16-pinned: pinned copy + question prefill, transformers alone), the engine
# pinned to raw and to level 1, the engine as shipped; memory store, disk store, links emulated at 10 and 25 Gbit/s;
# per request the choices, bytes, fetch and decode seconds (warm_path's `requests`); the miss overhead (miss-path
# rows); a request 2 s after a cold answer (after_cold) and a new model's first request (first_request); the decoder's kernel and
# call (coder_throughput); then the GPU tests. Each step runs under its own `timeout`; rows go to $OUT as they come
# (JSON lines, one file per step) with each step's log; a summary of every file's tail ends log.txt.
# --dry-run: the same Python steps on the CPU with a tiny shaped model and short contexts (no wheels installed, the
# GPU-only tests skip): run it here before a GPU is lent.
cd "$(dirname "$0")/../.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
STEPS=${*:-warm8k warm32k fresh coder tests}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ $DRY = 1 ]; then  # this machine's own cache (the reference tokenizer converted there already)
  PY=${PY:-python3}; DEV=cpu; MODEL="llama-shaped:layers=2,hidden=128,heads=4,kv_heads=2,intermediate=256"
  CTX8=3072; CTX32=6144; REPS8=1; REPS32=1; DATA=${DATA:-../shared/data/longchat_dev.jsonl}; THREADS=1
  CODER=(--quick --device cpu); TESTS=(tests/test_gpu_paths.py tests/test_pinned.py); BATCH=(--users 1 2 --context-tokens 460)
  STEPS_AT=(--users 1 2 --tokens 460 --pairs 2)
else
  PY=${PY:-python3}; DEV=cuda; MODEL=llama-7b-shaped; CTX8=7680; CTX32=30720; REPS8=3; REPS32=2
  DATA=.gpu/longchat_dev.jsonl; THREADS=16; CODER=(--device cuda); BATCH=(--users 1 4 16 --context-tokens 8192)
  STEPS_AT=(--users 1 4 8 --tokens 8192 --pairs 5)  # 8 own 8K buffers: 34 GB
  TESTS=(tests/test_gpu_paths.py tests/test_triton_decoder.py tests/test_pinned_paths.py tests/test_raw.py)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.gpu/bin:$PATH CACHEGEN_TOKENIZER_DIR=$PWD/.gpu/tok CACHEGEN_NATIVE_LIB=$PWD/.gpu/_native.so \
         CACHEGEN_CACHE_DIR=${CACHEGEN_CACHE_DIR:-/tmp/cgcache}  # a fresh one: no profile of the shaped model in it
fi
L=$OUT/log.txt
step() { local t=$1 name=$2; shift 2; local s=$SECONDS; timeout "$t" "$@" >> "$OUT/$name.log" 2>&1; local rc=$?
         echo "=== $name rc=$rc $((SECONDS - s)) s" | tee -a "$L"; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; lscpu | grep -E "Model name|^CPU\(s\)"
  "$PY" -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
  "$PY" -c "from cachegen_core.coders.native_lib import load_error; from cachegen_core.coders.triton_decoder import unavailable_reason; print('native:', load_error(), 'triton:', unavailable_reason('cuda'))"
} >> "$L" 2>&1
# the engine's profile fit off in the warm path (it would share the device with every row): first_request times it
WARM=(env CACHEGEN_AUTO_PROFILE=0 "$PY" -m benchmarks.warm_path --device "$DEV" --model "$MODEL" --transcripts 1 --data "$DATA"
      --policies text fp16 fp16-pinned cachegen-auto cachegen-raw cachegen-1 --stores memory disk emulated@10gbps emulated@25gbps)
for s in $STEPS; do
  case $s in
    warm8k) step 110 warm8k "${WARM[@]}" --contexts $CTX8 --reps $REPS8 --miss-contexts 2 --out "$OUT/warm_path_8k.jsonl" ;;
    warm32k) step 230 warm32k "${WARM[@]}" --contexts $CTX32 --reps $REPS32 --miss-contexts 2 --out "$OUT/warm_path_32k.jsonl" ;;
    fresh) step 40 after_cold "$PY" -m benchmarks.after_cold --device "$DEV" --model "$MODEL" --contexts $CTX8 $CTX32 \
             --data "$DATA" --out "$OUT/after_cold.jsonl"
           step 70 first_request "$PY" -m benchmarks.first_request --device "$DEV" --model "$MODEL" --dtype bfloat16 \
             --context $CTX8 --requests 4 --idle 12 --paired 3 --data "$DATA" --out "$OUT/first_request.jsonl" ;;
    coder) step 70 coder "$PY" -m benchmarks.coder_throughput "${CODER[@]}" --no-real --no-torchac --cpu-threads "" \
             --out "$OUT/coder_triton_7b.jsonl" ;;
    tests) step 120 tests "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" ;;
    batch) step 90 engine_step "$PY" -m benchmarks.ceiling --device "$DEV" --model "$MODEL" --engine "${STEPS_AT[@]}" \
             --out "$OUT/ceiling_engine.jsonl"
           step 300 batch "$PY" -m benchmarks.concurrency --device "$DEV" --model "$MODEL" --data "$DATA" --workloads shared own \
             --new-tokens 64 --modes threads --arrivals together --join 0 "${BATCH[@]}" --out "$OUT/concurrency.jsonl" ;;
    batch-calls) step 90 engine_step_calls env CACHEGEN_DECODE_KERNEL=0 "$PY" -m benchmarks.ceiling --device "$DEV" --model "$MODEL" \
             --engine "${STEPS_AT[@]}" --out "$OUT/ceiling_engine_calls.jsonl"
           step 300 batch_calls env CACHEGEN_DECODE_KERNEL=0 "$PY" -m benchmarks.concurrency --device "$DEV" --model "$MODEL" \
             --data "$DATA" --workloads shared own --new-tokens 64 --modes threads --arrivals together --join 0 "${BATCH[@]}" \
             --out "$OUT/concurrency_calls.jsonl" ;;
    groups) step 80 groups "$PY" -m benchmarks.transform_groups --device "$DEV" --out "$OUT/transform_groups.jsonl" ;;
    *) echo "unknown step $s" | tee -a "$L" ;;
  esac
done
for f in "$OUT"/*.log; do echo "--- $f"; tail -c 1200 "$f"; done >> "$L"
tail -c 4000 "$L"
