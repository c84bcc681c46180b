"""Without any entropy coder (no native library, no torchac: an sdist installed where no compiler was) the
engine still reuses contexts, from the raw 16-bit forms alone, says so once and answers as without a cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachegen_core.codec import KVCodec
from cachegen_core.coders import BackendUnavailable

ROOT = Path(__file__).resolve().parents[1]

# What a user's process looks like there: CACHEGEN_NATIVE_LIB names no library (set by the test's
# environment, before anything loads) and torchac cannot be imported (find_spec gives None for it).
SCRIPT = """
import json, sys
sys.modules["torchac"] = None
import torch
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from langchain_cachegen import CacheGenLLM

def run(llm, prompt):
    gen = llm.generate([prompt]).generations[0][0]
    info = gen.generation_info
    return {"text": gen.text, "cached": info["cached_tokens"], "levels": info["levels"], "errors": info["errors"]}

prompt = words(7, 200)
# text off: a tiny model prefills a 64-token chunk about as fast as it is fetched, and under CI's load the controller
# once predicted the last chunk sooner as text (exact, but not the reuse asserted here)
llm = CacheGenLLM.from_model_id(sys.argv[1], store=MemoryStore(), chunk_tokens=64, background=False, dtype=torch.bfloat16,
                                generation_kwargs={"max_new_tokens": 8}, engine_kwargs={"allow_text": False})
again = CacheGenLLM.from_model_id(sys.argv[1], store=MemoryStore(), chunk_tokens=64, dtype=torch.bfloat16,
                                  generation_kwargs={"max_new_tokens": 8})  # a second engine: no second warning
cold, warm = run(llm, prompt), run(llm, prompt)
tok, model = llm.engine.tokenizer, llm.engine.model
ids = torch.tensor([tok(prompt)["input_ids"]])
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
plain = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
print(json.dumps({"cold": cold, "warm": warm, "plain": plain, "coder": llm.engine.codec.coder,
                  "options": llm.engine.store_options}))
"""


def test_a_warm_request_reuses_the_raw_form_without_any_coder(tiny_model_dir, tmp_path):
    env = {**os.environ, "CACHEGEN_NATIVE_LIB": str(tmp_path / "nowhere" / "libnative.so"), "CACHEGEN_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_dir], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["coder"] is None and got["options"] == ["lossless"]  # a bfloat16 model: its KV bit for bit, in 16 bits
    cold, warm = got["cold"], got["warm"]
    assert cold["cached"] == 0 and warm["cached"] == 192 and warm["levels"] == ["lossless"] * 3 and not warm["errors"]
    assert warm["text"] == cold["text"] == got["plain"]  # the exact KV: the answer without a cache
    said = [line for line in proc.stderr.splitlines() if "no entropy coder can run here" in line]
    assert len(said) == 1, proc.stderr[-3000:]  # once per process, however many engines
    assert "nowhere" in said[0] and "torchac is not installed" in said[0] and "pip install" in said[0] and ".whl" in said[0]


def test_a_codec_without_a_coder_refuses_levels_with_a_typed_error(monkeypatch, tiny_kv):
    from cachegen_core.coders import registry

    monkeypatch.setattr(registry, "fastest_coder", lambda: None)
    monkeypatch.setattr("cachegen_core.codec.kvcodec.fastest_coder", lambda: None)
    codec = KVCodec()
    assert codec.coder is None and codec.levels  # built: its ids and levels still key and describe chunks
    with pytest.raises(BackendUnavailable, match="no entropy coder can run here"):
        codec.encode(tiny_kv, 1, start=0)
    with pytest.raises(BackendUnavailable, match="no entropy coder can run here"):
        KVCodec(device="cuda")


def test_only_dropped_levels_are_warned_about_and_only_once(monkeypatch, caplog):
    import threading

    import torch

    from cachegen_core.engine.chunks import options

    monkeypatch.setattr("cachegen_core.codec.kvcodec.fastest_coder", lambda: None)
    monkeypatch.setattr(options, "_warned", threading.Event())
    codec = KVCodec()
    with caplog.at_level("WARNING", logger="cachegen_core.engine"):
        assert options.storable(["lossless"], codec, torch.bfloat16) == ["lossless"]  # nothing to give up: not said
        assert not caplog.records
        assert options.storable(["raw", 1, 3], codec, torch.float32) == ["raw"]
        assert options.storable([1], codec, torch.float32) == ["raw"] and options.storable([1], codec, torch.float16) == ["lossless"]
    assert len(caplog.records) == 1 and options.INSTALL_WHEEL in caplog.records[0].getMessage()
