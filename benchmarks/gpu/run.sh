#!/bin/bash
# On a lent GPU machine (the device tool: `run` with carry [".gpu", ".whl"], after benchmarks/gpu/prepare.sh):
# the GPU decoder's tests, the Triton coder's throughput, the transform-group A/B and the 7B-shaped warm
# path, each under its own timeout; logs and JSON lines under $OUT. About 6 minutes on an H100.
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.gpu/bin:$PATH CACHEGEN_TOKENIZER_DIR=$PWD/.gpu/tok CACHEGEN_CACHE_DIR=/tmp/cgcache \
       CACHEGEN_NATIVE_LIB=$PWD/.gpu/_native.so
L=$OUT/log.txt
step() { local t=$1 name=$2; shift 2; local s=$SECONDS; timeout "$t" "$@" >> "$L.$name" 2>&1; local rc=$?
         echo "=== $name rc=$rc $((SECONDS - s)) s" | tee -a "$L"; }
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  python3 -c "from cachegen_core.coders.native_lib import load_error; from cachegen_core.coders.triton_decoder import unavailable_reason; print('native:', load_error(), 'triton:', unavailable_reason('cuda'))"
} >> "$L" 2>&1
step 100 tests python3 -m pytest -q -p no:cacheprovider tests/test_triton_decoder.py
step 80 coder python3 -m benchmarks.coder_throughput --device cuda --no-real --no-torchac --cpu-threads 16 --out "$OUT/coder_triton_7b.jsonl"
step 80 groups python3 -m benchmarks.transform_groups --device cuda --out "$OUT/transform_groups.jsonl"
step 280 warm python3 -m benchmarks.warm_path --device cuda --model llama-7b-shaped --contexts 7680 --transcripts 1 --reps 3 \
     --miss-contexts 0 --stores memory redis@10gbps --data .gpu/longchat_dev.jsonl --out "$OUT/warm_path_7b.jsonl"
for f in "$L".*; do echo "--- $f"; tail -c 1500 "$f"; done
cat "$L".* >> "$L"; rm -f "$L".*
