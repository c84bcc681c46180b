import logging

import pytest
import torch

from cachegen_core.keys.chunks import blob_key
from cachegen_core.engine import KVEngine
from cachegen_core.hfcompat import cache_arg
from cachegen_core.stores.disk import DiskCacheStore
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_llama, make_tiny_tokenizer, reorder_tolerance, words

CHUNK = 64


def plain_greedy(model, tok, prompt, n=10):
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture
def engine(tiny_llama, tiny_tokenizer):
    # level 0 only: these tests follow the compression codec (raw forms have their own tests); text off: on the tiny
    # model prefilling a chunk ties with fetching it, and a fetch timed during a stall made the corrupted chunk text
    return KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, store_options=[0], background=False,
                    allow_text=False)  # fmt: skip


def test_second_call_hits_every_complete_chunk_and_matches_plain_model(tiny_llama, tiny_tokenizer):
    # text never chosen instead of a chunk: on a tiny model prefilling 64 tokens and decoding them tie,
    # and the controller's pick between them depends on timings
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, store_options=[0],
                      background=False, allow_text=False)  # fmt: skip
    prompt = words(2, 200)  # level 0 is near-lossless: prompts whose greedy margin a tiny random model keeps
    first, info1 = engine.generate(prompt, max_new_tokens=10)
    assert info1.cached_tokens == 0 and info1.recomputed_tokens == 200 and info1.chunks_queued == 3
    second, info2 = engine.generate(prompt, max_new_tokens=10)
    assert info2.cached_tokens == 192 and info2.recomputed_tokens == 8
    assert info2.levels == [0, 0, 0] and info2.bytes_fetched > 0 and info2.ttft_s > 0
    assert first == second == plain_greedy(tiny_llama, tiny_tokenizer, prompt)


def test_exact_multiple_of_chunk_size_still_generates(engine, tiny_llama, tiny_tokenizer):
    prompt = words(2, 2 * CHUNK)
    engine.generate(prompt, max_new_tokens=6)
    text, info = engine.generate(prompt, max_new_tokens=6)
    assert info.cached_tokens == 2 * CHUNK - 1 and info.recomputed_tokens == 1
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 6)


def test_shared_prefix_reuses_exactly_the_shared_chunks(engine):
    base = words(3, 4 * CHUNK).split()
    engine.generate(" ".join(base), max_new_tokens=2)
    other = base[: 2 * CHUNK] + words(4, 2 * CHUNK).split()
    _, info = engine.generate(" ".join(other), max_new_tokens=2)
    assert info.cached_tokens == 2 * CHUNK
    changed = list(base)
    changed[2 * CHUNK + 5] = "w3" if changed[2 * CHUNK + 5] != "w3" else "w4"  # one token of chunk 2
    _, info = engine.generate(" ".join(changed), max_new_tokens=2)
    assert info.cached_tokens == 2 * CHUNK  # chunks >= 2 miss


@pytest.mark.parametrize("variant", ["model", "dtype", "tokenizer"])
def test_other_model_dtype_or_tokenizer_never_hits(engine, tiny_llama, tiny_tokenizer, variant):
    prompt = words(5, 3 * CHUNK)
    engine.generate(prompt, max_new_tokens=2)
    model, tok = tiny_llama, tiny_tokenizer
    if variant == "model":
        model = make_tiny_llama(seed=1)
    elif variant == "dtype":
        model = make_tiny_llama(dtype=torch.bfloat16)
    else:
        tok = make_tiny_tokenizer()
        tok.add_tokens(["extra"])
    other = KVEngine(model, tok, store=engine.store, chunk_tokens=CHUNK, level=0, background=False)
    assert other.fingerprint != engine.fingerprint
    _, info = other.generate(prompt, max_new_tokens=2)
    assert info.cached_tokens == 0


def test_corrupted_blob_is_recomputed_and_logged(engine, tiny_llama, tiny_tokenizer, caplog):
    prompt = words(7, 3 * CHUNK + 10)
    engine.generate(prompt, max_new_tokens=8)
    chunks = engine.chunks(prompt)
    key = blob_key(chunks[1].key, engine.level)
    blob = bytearray(engine.store.get(key))
    blob[len(blob) // 2] ^= 0xFF
    engine.store.put(key, bytes(blob))
    with caplog.at_level(logging.WARNING, logger="cachegen_core.engine"):
        text, info = engine.generate(prompt, max_new_tokens=8)
    assert info.cached_tokens == CHUNK  # chunk 0 reused, chunk 1 bad, the rest recomputed
    assert any("bad blob for chunk 1" in r.getMessage() for r in caplog.records)
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 8)


def test_a_blob_verified_once_is_not_hashed_again_but_a_replaced_one_is(tiny_llama, tiny_tokenizer, monkeypatch):
    """The memory store hands back the objects it holds: the reader skips re-verifying the very bytes object it
    verified in the last stream, and verifies anything put under the key since (a corruption is still caught)."""
    # text never chosen instead of a chunk: on a tiny model prefilling 64 tokens and decoding them tie
    engine = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, store_options=[0],
                      background=False, allow_text=False)  # fmt: skip
    prompt = words(7, 3 * CHUNK + 10)
    engine.generate(prompt, max_new_tokens=8)
    checks = []
    check = engine.codec.check
    monkeypatch.setattr(engine.codec, "check", lambda blob, level=None: checks.append(level) or check(blob, level))
    engine.generate(prompt, max_new_tokens=8)
    assert len(checks) == 3  # the first warm stream verifies every chunk
    _, info = engine.generate(prompt, max_new_tokens=8)
    assert len(checks) == 3 and info.cached_tokens == 3 * CHUNK  # the same objects: not hashed again
    key = blob_key(engine.chunks(prompt)[1].key, engine.level)
    blob = bytearray(engine.store.get(key))
    blob[len(blob) // 2] ^= 0xFF
    engine.store.put(key, bytes(blob))
    text, info = engine.generate(prompt, max_new_tokens=8)
    assert len(checks) == 4 and info.cached_tokens == CHUNK and "bad blob for chunk 1" in info.errors[0]
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 8)


def test_raw_chunks_on_disk_are_read_into_kept_buffers_and_still_checked(tiny_tokenizer, tmp_path):
    """The disk store reads a raw chunk into one of the reader's kept buffers (no fresh memory per read); the blob
    is verified as any other (a corrupted file is caught) and, for a 16-bit model, the answer is the no-cache one."""
    model = make_tiny_llama(dtype=torch.bfloat16)  # raw = the model's dtype: exact
    store = DiskCacheStore(tmp_path, disk_min_file_size=0)  # every value in a file, as real chunks are
    e = KVEngine(model, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level=1, store_options=["raw"], allow_text=False,
                 background=False)  # fmt: skip
    prompt = words(7, 3 * CHUNK + 10)
    expected, _ = e.generate(prompt, max_new_tokens=8)
    text, info = e.generate(prompt, max_new_tokens=8)
    kept = {id(b) for b in e.reader._read_buffers}
    assert info.levels == ["raw"] * 3 and text == expected and len(kept) == 2
    text, info = e.generate(prompt, max_new_tokens=8)
    assert info.levels == ["raw"] * 3 and text == expected and {id(b) for b in e.reader._read_buffers} == kept
    key = blob_key(e.chunks(prompt)[1].key, "raw")
    blob = bytearray(store.get(key))
    blob[len(blob) // 2] ^= 0xFF
    store.put(key, bytes(blob))
    text, info = e.generate(prompt, max_new_tokens=8)
    assert info.cached_tokens == CHUNK and "bad blob for chunk 1" in info.errors[0] and text == expected


def test_foreign_blob_planted_under_a_key_is_rejected(engine, tiny_llama, tiny_tokenizer):
    prompt = words(7, 2 * CHUNK + 3)
    engine.generate(prompt, max_new_tokens=4)
    c0 = engine.chunks(prompt)[0]
    other = KVEngine(make_tiny_llama(seed=9), tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=0, background=False)
    foreign = other.codec.encode(other.calculate_kv(words(8, CHUNK)), 0, start=0)
    engine.store.put(blob_key(c0.key, 0), foreign)
    text, info = engine.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == 0 and "another model" in info.errors[0]
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 4)


def test_background_store_and_flush(tiny_llama, tiny_tokenizer):
    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level=1, store_options=[1], background=True,
                 allow_text=False)  # fmt: skip
    prompt = words(9, 2 * CHUNK + 1)
    e.generate(prompt, max_new_tokens=2)
    assert e.flush(timeout=60)
    assert e.store_stats["written"] == 2
    _, info = e.generate(prompt, max_new_tokens=2)
    assert info.cached_tokens == 2 * CHUNK and info.levels == [1, 1]


def test_store_kv_get_kv_generate_with_kv(engine, tiny_llama, tiny_tokenizer):
    context = words(10, 2 * CHUNK)
    ids = engine.store_kv(context)
    assert len(ids) == 2
    kv = engine.get_kv(ids)
    assert kv.num_tokens == 2 * CHUNK
    exact = engine.calculate_kv(context)
    assert (kv.keys - exact.keys).abs().max() < 0.05 * exact.keys.abs().max()
    prompt = context + " " + words(11, 5)
    assert engine.generate_with_kv(kv, prompt, max_new_tokens=6) == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 6)


def test_a_level_codes_each_chunk_at_its_own_position(engine):
    # keys are coded before the rotary embedding of the chunk's own positions: coded as if at position 0, every chunk
    # after the first had its keys turned by a constant angle the profile's transform does not expect (47 % larger blobs)
    context = words(14, 3 * CHUNK)
    keys = engine.store_kv(context)
    exact = engine.calculate_kv(context)
    for i, key in enumerate(keys):
        checked = engine.codec.check(engine.store.get(blob_key(key, 0)), 0)
        assert checked.header.start == i * CHUNK
        kv, ref = engine.codec.decode(checked), exact.slice(i * CHUNK, (i + 1) * CHUNK)
        assert (kv.keys - ref.keys).abs().max() < 0.05 * ref.keys.abs().max()  # level 0: near-lossless, at these positions


def test_stream_matches_generate(engine):
    prompt = words(12, 150)
    text, _ = engine.generate(prompt, max_new_tokens=8)
    items = list(engine.stream(prompt, max_new_tokens=8))
    assert "".join(items[:-1]).strip() == text.strip() and items[-1].cached_tokens == 128


def test_empty_prompt_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate("")


def test_stop_strings_use_transformers_criterion_where_it_maps_the_tokenizer(tiny_tokenizer):
    from transformers import StopStringCriteria

    from cachegen_core.engine.model.hf import _StopOnDecodedText, stop_criterion

    # a word-level vocabulary is beyond StopStringCriteria's subword cleaning: the decoded-text check takes over
    assert isinstance(stop_criterion(tiny_tokenizer, ["w9"], 3), _StopOnDecodedText)
    importlib = pytest.importorskip("importlib.util")
    from cachegen_core import models

    if importlib.find_spec(models.REFERENCE_PACKAGE) is None or not models.model_dir_for(models.REFERENCE_MODEL)[1]:
        pytest.skip("the reference model is not prepared (make test prepares it)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.resolve_model(models.REFERENCE_MODEL), local_files_only=True)
    assert isinstance(stop_criterion(tok, ["\n\n", "Human:"], 3), StopStringCriteria)


def test_model_cache_appends_in_place_into_spare_capacity(tiny_llama, tiny_tokenizer):
    """A reused KV with spare capacity is handed to transformers as is: the question's and the answer's
    tokens are written into it (no copy of the whole cache per forward), with the output of a plain run."""
    from cachegen_core.engine.model import hf
    from cachegen_core.kv import KVCache

    ids = tiny_tokenizer(words(3, 300))["input_ids"]
    buf = KVCache(torch.empty(3, 2, 400, 16), torch.empty(3, 2, 400, 16))
    prefix = hf.prefill(tiny_llama, ids[:256])
    buf.keys[:, :, :256], buf.values[:, :, :256] = prefix.keys, prefix.values
    cache = hf.model_cache(tiny_llama, buf, 256)
    assert type(cache.layers[0]).__name__ == "_InPlaceLayer" and cache.get_seq_length() == 256
    with torch.no_grad():
        out = tiny_llama.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  **cache_arg(tiny_llama, cache), max_new_tokens=20, do_sample=False, pad_token_id=2)  # fmt: skip
    text = tiny_tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, words(3, 300), 20)
    assert cache.layers[0].keys.data_ptr() == buf.keys.data_ptr()  # still the caller's buffer
    assert cache.layers[0].values.data_ptr() == buf.values.data_ptr()
    full = hf.prefill(tiny_llama, ids)
    # the question's KV landed in place: a full prefill's, up to float32 rounding of its sums (attention over
    # up to 300 positions) in another order, which the CPU decides (Zen: 9e-7 in layer 2, about 4 ulps of |K| = 3)
    for got, want in ((buf.keys[:, :, 256:300], full.keys[:, :, 256:300]), (buf.values[:, :, 256:300], full.values[:, :, 256:300])):
        assert (got - want).abs().max() <= reorder_tolerance(want, terms=300)
    small = KVCache(buf.keys[:, :, :257].clone(), buf.values[:, :, :257].clone())
    cache = hf.model_cache(tiny_llama, small, 256)  # one spare slot: later tokens fall back to concatenation
    with torch.no_grad():
        out = tiny_llama.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  **cache_arg(tiny_llama, cache), max_new_tokens=20, do_sample=False, pad_token_id=2)  # fmt: skip
    assert tiny_tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True) == text


def test_levels_decode_where_the_model_is_when_the_coder_can_and_on_the_cpu_otherwise(engine, monkeypatch):
    """A model on a GPU gets its chunks decoded there when the coder has a decoder that runs; the reason is
    said when it has not (here: no GPU)."""
    from cachegen_core.coders import registry

    assert engine.reader.decode_device.type == "cpu" and engine.reader.use_device(torch.device("cpu")) is None
    why = engine.reader.use_device(torch.device("cuda"))
    assert engine.reader.decode_device.type == "cpu" and why  # no GPU here: the reason is given

    class FakeGpuDecoder:  # what a working GPU decoder looks like to the reader
        def __init__(self, device):
            self.device = device

    monkeypatch.setitem(registry.DEVICE_DECODERS, (engine.codec.coder.name, "cuda"), FakeGpuDecoder)
    assert engine.reader.use_device(torch.device("cuda")) is None and engine.reader.decode_device.type == "cuda"


def test_finish_reason_says_why_generation_ended(engine):
    prompt = words(60, 40)
    text, info = engine.generate(prompt, max_new_tokens=6)
    assert info.finish_reason == "length" and info.new_tokens == 6 and info.stop_sequence is None
    stop = text.split()[2]
    _, info = engine.generate(prompt, max_new_tokens=6, stop=[stop])
    assert info.finish_reason == "stop" and info.stop_sequence == stop and info.new_tokens < 6


def _sdpa_and_ours(seed: int) -> tuple:
    """Two tiny Llamas with the same weights: one on transformers' sdpa, one on the engine's attention."""
    from cachegen_core.engine.model.attention import NAME, use_gqa_attention

    base, gqa = make_tiny_llama(seed=seed), make_tiny_llama(seed=seed)
    base.set_attn_implementation("sdpa")
    gqa.set_attn_implementation("sdpa")
    assert use_gqa_attention(gqa) and gqa.config._attn_implementation == NAME
    return base, gqa


def _prefill_after_prefix(monkeypatch, seed: int, ids: list[int], prefix: int, spied: str, mode=torch.no_grad) -> tuple[list[int], int]:
    """``ids[prefix:]`` prefilled after a reused ``ids[:prefix]``: the engine's attention's logits asserted to be
    sdpa's; the query counts ``engine.attention.<spied>`` was called with, and the model's layers."""
    from cachegen_core.engine.model import attention, hf

    base, gqa = _sdpa_and_ours(seed)
    calls = []
    real = getattr(attention, spied)
    monkeypatch.setattr(attention, spied, lambda *a: calls.append(a[0].shape[2]) or real(*a))
    with mode():
        past = hf.prefill(base, ids[:prefix])
        a = base(torch.tensor([ids[prefix:]]), **cache_arg(base, hf.model_cache(base, past))).logits
        b = gqa(torch.tensor([ids[prefix:]]), **cache_arg(gqa, hf.model_cache(gqa, past))).logits
    assert torch.allclose(a, b, atol=1e-5)
    return calls, gqa.config.num_hidden_layers


def test_gqa_attention_gives_sdpas_results_without_copying_kv_heads(tiny_tokenizer, monkeypatch):
    """The attention the engine gives models it loads: the same logits as transformers' sdpa, on a prompt and
    on a question after a reused cache (where sdpa copies the KV heads)."""
    from cachegen_core.engine.model.attention import use_gqa_attention

    base, gqa = _sdpa_and_ours(4)
    ids = tiny_tokenizer(words(80, 150))["input_ids"]
    with torch.no_grad():
        assert torch.allclose(base(torch.tensor([ids])).logits, gqa(torch.tensor([ids])).logits, atol=1e-5)
    assert _prefill_after_prefix(monkeypatch, 4, ids, 140, "blocked_offset_attention")[0] == []
    mha = make_tiny_llama(seed=4, kv_heads=4)
    mha.set_attn_implementation("sdpa")
    assert not use_gqa_attention(mha)  # nothing to gain without grouped heads: left as it is


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("prefix", [20, 50, 90])
def test_prefill_after_a_short_prefix_skips_the_masked_half(tiny_tokenizer, monkeypatch, prefix, mode):
    """Many tokens prefilled after a short reused prefix (at most half their number) take the causal kernel on
    padded queries, with sdpa's logits; a longer prefix keeps the masked call. Under ``inference_mode`` too,
    whose masks have no version counter (the model a user gets from ``from_pretrained`` is theirs to call)."""
    ids = tiny_tokenizer(words(81, 200))["input_ids"][: prefix + 100]
    calls, layers = _prefill_after_prefix(monkeypatch, 5, ids, prefix, "offset_causal_attention", mode)
    assert calls == ([100] * layers if prefix <= 50 else [])


@pytest.mark.parametrize(("prefix", "new", "blocked"), [(600, 700, True), (1400, 700, True), (600, 300, False)])
def test_prefill_after_a_longer_prefix_runs_its_queries_in_blocks(monkeypatch, prefix, new, blocked):
    """Many tokens after a prefix longer than half their number: the queries in blocks, each over the keys it may
    see, with sdpa's logits (fewer than two blocks' worth keep the one masked call)."""
    ids = torch.randint(3, 128, (prefix + new,), generator=torch.Generator().manual_seed(6)).tolist()
    calls, layers = _prefill_after_prefix(monkeypatch, 6, ids, prefix, "blocked_offset_attention")
    assert calls == ([new] * layers if blocked else [])
