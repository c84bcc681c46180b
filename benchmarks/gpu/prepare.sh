#!/bin/bash
# Prepare what a lent GPU machine (bare, no registry access, Python 3.12 with torch, Triton, transformers) needs
# to run benchmarks/gpu/run.sh: wheels of what its image lacks in .whl/, and in .gpu/ the native library built
# here, redis-server with its libraries, the reference tokenizer's files and the dev transcripts. Both folders
# are ignored (.git/info/exclude); name them in the device call's `carry`. Run from the repository root
# after `make test` (or `make install`) has built the native library and provisioned the reference model.
set -euo pipefail
PY=${PY:-.venv/bin/python}
grep -qxF /.whl/ .git/info/exclude 2>/dev/null || printf '/.whl/\n/.gpu/\n' >> .git/info/exclude
mkdir -p .whl .gpu/bin .gpu/lib .gpu/tok
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the versions this environment runs (pydantic and pydantic-core must agree)
pins=$("$PY" -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in ("diskcache", "redis", "xxhash", "platformdirs", "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "typing-inspection", "annotated-types")))')
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl $pins
cp "$("$PY" -c 'import cachegen_core.coders.native_lib as n; print(n._library_path())')" .gpu/_native.so
cp "$(command -v redis-server)" .gpu/bin/redis-server.real
for lib in $(ldd .gpu/bin/redis-server.real | awk '/=>/ {print $3}' | grep -v -E 'libc\.so|libm\.so|libstdc|libgcc_s|ld-linux'); do cp -L "$lib" .gpu/lib/; done
cat > .gpu/bin/redis-server <<'SH'
#!/bin/sh
d=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$d/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/redis-server.real" "$@"
SH
chmod +x .gpu/bin/redis-server
model=$("$PY" -c 'from cachegen_core.models import resolve_model; print(resolve_model("smollm2-135m"))')
cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/config.json .gpu/tok/
cp ../shared/data/longchat_dev.jsonl .gpu/
du -sh .whl .gpu
echo "check run.sh's Python steps here before a GPU is lent (CPU, a tiny shaped model, a few minutes):"
echo "  OUT=/tmp/out-dry PY=$PY DATA=../shared/data/longchat_dev.jsonl bash benchmarks/gpu/run.sh --dry-run"
