"""The compatibility matrix: every model family the engine serves, on a tiny random-init model of it.

Per family: a lossless warm answer (complete chunks, a partial chunk, a prompt extending it) is the model's own
greedy ``generate``, as the cold one is, for prompts shorter and longer than a sliding window and chunk boundaries
on both sides of it; the KV a request builds is the model's; level 1 and partial chunks run; document caches and
the blend work or are refused with their reason. ``docs/models.md`` holds the same table.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from cachegen_core.engine import KVEngine, UnsupportedModel
from cachegen_core.engine.model.attention import use_gqa_attention
from cachegen_core.engine.documents.blend import BlendConfig, blend_support
from cachegen_core.hfcompat import cache_arg, output_cache
from cachegen_core.kv import KVCache, KVShapeError
from cachegen_core.codec.kvstats import kv_statistics
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import FAMILIES, make_family_model, make_tiny_kv, make_tiny_tokenizer, words
from cachegen_core.testing.families import WINDOW

SERVED = [name for name in FAMILIES if name != "qwen3-next"]
#: Families whose document caches are blended (CacheBlend); the others get documents as text, for this reason.
BLENDED = {"llama", "llama-rope-llama3", "llama-rope-linear", "llama-rope-yarn", "qwen2", "mistral"}
NO_BLEND = {name: "sliding-window attention is not supported" for name in ("mistral-4096", "mistral-window", "qwen2-window")}
#: Families also run on the engine's own attention (grouped KV heads on SDPA): Llama and every such sliding-window one.
ATTENTION = ["llama", "qwen2-window", "mistral-4096", "mistral-window", "phi3-window", "gemma3-text-window"]
CHUNK, STEP = 32, 8  # chunk ends 32 < WINDOW (48) < 64, 96
NEW = 8
assert CHUNK < WINDOW < 2 * CHUNK


@functools.lru_cache(maxsize=None)
def _model(name: str):
    return make_family_model(name)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Ops on 64-wide tensors: a second intra-op thread only adds hand-offs (2-20x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _engine(name: str, tok, **kw) -> KVEngine:
    kw = {"store": MemoryStore(), "level": "lossless", "chunk_tokens": CHUNK, "partial_step": STEP, "background": False, **kw}
    return KVEngine.from_pretrained(_model(name), tokenizer=tok, **kw)


def _greedy(model, ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return [t for t in out[0, x.shape[1] :].tolist() if t != 2]  # the engine's text leaves the end of sequence out


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _reference_kv(model, ids: list[int]) -> KVCache:
    """The model's KV of ``ids`` in one forward, in a cache of plain layers (which keep every token)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, **cache_arg(model, DynamicCache()))
    return KVCache.from_dynamic_cache(output_cache(out))


def _assert_kv_close(kv: KVCache, ref: KVCache) -> None:
    # float32 throughout; the same maths in other shapes (a prefix computed apart from its tail) differs by rounding
    torch.testing.assert_close(kv.keys, ref.keys, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv.values, ref.values, rtol=1e-4, atol=1e-4)


def _check_lossless(name: str, engine: KVEngine, tok, reference) -> None:
    """Cold and warm answers of ``engine`` against ``reference``'s greedy ``generate``; the KV it builds and stores."""
    short = words(11, 30)  # 31 tokens with BOS: inside the window
    long = f"{short} {words(12, 80)}"  # 111: past it, its first 24 tokens from the short prompt's partial chunk
    for prompt in (short, long, f"{long} {words(13, 20)}"):  # the last extends the long one: chunks and a partial chunk
        ids = engine.tokenize(prompt)
        want = _greedy(reference, ids)
        assert len(want) == NEW
        first, first_info = engine.generate(prompt, max_new_tokens=NEW)
        warm, info = engine.generate(prompt, max_new_tokens=NEW)
        assert _ids(tok, first) == want, f"{name}: the first answer is not the model's"
        assert _ids(tok, warm) == want, f"{name}: the answer on a reused cache is not the model's"
        assert info.cached_tokens >= len(ids) - STEP and not info.errors and not first_info.errors
    ref = _reference_kv(reference, engine.tokenize(long))
    _assert_kv_close(engine.prompt_kv(long)[0], ref)  # what the stored chunks and partial chunk hold
    _assert_kv_close(engine.calculate_kv(long), ref)


@pytest.mark.parametrize("name", SERVED)
def test_lossless_reuse_answers_as_the_models_own_generate(name, tok):
    _check_lossless(name, _engine(name, tok), tok, _model(name))


@pytest.mark.parametrize("name", SERVED)
def test_a_batch_of_requests_answers_as_each_request_alone(name, tok):
    """Requests of different lengths, sharing a prefix and not, stored and not, cold and warm: one batch
    (``generate_many``: prompts sharing a batch-mate's prefix read it in place) and threads beside a running request
    (which read its prefix in place): every greedy answer is the model's own ``generate`` of the request alone."""
    import threading

    model, engine = _model(name), _engine(name, tok)
    context = words(20, 70)  # past the sliding window (48)
    prompts = [f"{context} {words(21, 5)}", f"{context} {words(22, 30)}", words(23, 40), f"{context} {words(24, 12)}", words(25, 90)]
    engine.generate(prompts[2], max_new_tokens=2)  # one of them stored: its chunks streamed, the others computed
    results = engine.generate_many(prompts, max_new_tokens=NEW)
    alone = [tok.decode(_greedy(model, engine.tokenize(p)), skip_special_tokens=True) for p in prompts]
    for want, (text, info) in zip(alone, results):
        assert text == want, f"{name}: a batched answer is not the model's"
        assert not info.errors
    assert sum(info.shared_tokens > 0 for _, info in results) >= 2  # the context computed once for three prompts
    out: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i, p=p: out.__setitem__(i, engine.generate(p, max_new_tokens=NEW)[0]))
               for i, p in enumerate(prompts)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(prompts))] == alone


@pytest.mark.parametrize("name", ATTENTION)
def test_the_engines_own_attention_answers_as_sdpa(name, tok):
    """Models the engine loads itself get its SDPA (``attention.py``): same answers and KV as transformers' SDPA."""
    model = make_family_model(name)
    assert use_gqa_attention(model)
    engine = KVEngine(model, tok, store=MemoryStore(), level="lossless", chunk_tokens=CHUNK, partial_step=STEP, background=False)
    _check_lossless(name, engine, tok, _model(name))


@pytest.mark.parametrize("name", SERVED)
def test_level_1_and_partial_chunks_run(name, tok):
    engine = _engine(name, tok, level=1, store_options=[1], allow_text=False)  # on a tiny model text is faster
    prompt = words(14, 106)  # 107 tokens: chunks to 96 and a partial chunk to 104
    engine.generate(prompt, max_new_tokens=2)
    text, info = engine.generate(f"{prompt} {words(15, 12)}", max_new_tokens=4)
    assert text and info.cached_tokens == 96 + 8 and info.partial_tokens == 8 and info.levels and set(info.levels) == {1}
    assert not info.errors


def _documents_prompt(engine: KVEngine, docs: list[str]):
    parts = [("context for the question", False)]
    for d in docs:
        parts += [(d, True), ("next", False)]
    return engine.segment([*parts, ("which one", False)])


@pytest.mark.parametrize("name", SERVED)
def test_document_caches_are_blended_or_refused_with_a_reason(name, tok):
    model, docs = _model(name), [words(16, 60), words(17, 60)]
    engine = _engine(name, tok, level="raw", store_options=["raw"], blend=BlendConfig(recompute_ratio=1.0))
    stored = engine.store_documents(docs)
    prompt = _documents_prompt(engine, docs[::-1])
    text, info = engine.generate(prompt, max_new_tokens=NEW)
    assert _ids(tok, text) == _greedy(model, list(prompt.ids))  # everything recomputed, or documents as text: exact
    assert info.documents == 2 and not info.errors
    support = blend_support(model)
    if name in BLENDED:
        assert not isinstance(support, str) and stored.stored and info.documents_reused == 2
        default = _engine(name, tok, level="raw", store_options=["raw"], store=engine.store)  # the default 15 % budget
        text, info = default.generate(prompt, max_new_tokens=NEW)
        assert text and info.documents_reused == 2 and 0 < info.blend_recomputed < 120
    else:
        reason = NO_BLEND.get(name, "is not of the Llama family")
        assert isinstance(support, str) and reason in support
        assert not stored.stored and info.documents_reused == 0  # nothing stored that is never read


def test_a_linear_attention_layer_is_refused_at_load(tok):
    with pytest.raises(UnsupportedModel, match="linear_attention"):
        KVEngine.from_pretrained(make_family_model("qwen3-next"), tokenizer=tok, store=MemoryStore())


@pytest.mark.parametrize("name", ["mistral-window", "gemma2-window"])
def test_kv_outside_the_engine_keeps_every_token_of_a_sliding_layer(name):
    """Profiles' statistics and ``make_tiny_kv`` take a model's KV past its window whole; a transformers cache
    that dropped tokens is an error, never a shorter KV."""
    model, tokens = _model(name), 2 * WINDOW
    ids = torch.randint(3, 128, (tokens + 16,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        own = output_cache(model(torch.tensor([ids[:tokens]]), use_cache=True))  # transformers' cache: the window only
    with pytest.raises(KVShapeError, match="sliding window"):
        KVCache.from_dynamic_cache(own)
    stats = kv_statistics(model, [ids], rotary=None, contexts=(tokens,), continuation=16, chunk_tokens=CHUNK, sink_tokens=1)
    assert stats.covariance_tokens == stats.fisher_tokens == tokens - 1  # every token but the sink
    assert make_tiny_kv(model, tokens).num_tokens == tokens


def test_the_in_place_sliding_layer_reads_as_transformers_own():
    """Update by update, the buffer's sliding layer hands attention the keys, values and mask sizes transformers'
    ``DynamicSlidingWindowLayer`` does, and keeps every token (in the buffer, with no copy while it has room)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from cachegen_core.engine.model.hf import _InPlaceSlidingLayer

    window, g = 8, torch.Generator().manual_seed(0)
    steps = [torch.randn(1, 2, n, 4, generator=g) for n in (5, 1, 3, 6, 1, 1, 9, 2)]  # runs past the window and out of room
    buf = torch.empty(1, 2, 20, 4)
    buf[:, :, :5] = steps[0]
    mine, theirs = _InPlaceSlidingLayer(buf, buf.clone(), 5, window), DynamicSlidingWindowLayer(window)
    theirs.update(steps[0], steps[0].clone())
    for new in steps[1:]:
        q = new.shape[-2]
        assert mine.get_mask_sizes(q) == theirs.get_mask_sizes(q) == mine.get_mask_sizes(torch.arange(q) + mine.get_seq_length())
        assert mine.get_seq_length() == theirs.get_seq_length()
        k, v = mine.update(new, new.clone())
        k_ref, v_ref = theirs.update(new, new.clone())
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # the same tensors, sliced differently
    assert torch.equal(mine.keys, torch.cat(steps, dim=-2)) and mine._kbuf is None  # 28 tokens: past the buffer's 20


@pytest.mark.parametrize("name", SERVED)
def test_step_weights_are_measured_and_coded_with_on_every_family(name, tok):
    """What an engine without a profile measures at load (``fitting.fit_weights``): one Fisher draw, whatever the
    family's attention, rotary or sliding window; a level-1 request then reuses chunks coded with the weights."""
    from cachegen_core.codec.fitting import fit_weights
    from cachegen_core.codec.rotary import RotarySpec
    from cachegen_core.codec.weights import check_weights

    model = _model(name)
    w = fit_weights(model, tok, words(16, 300), rotary=RotarySpec.from_model(model), context=96, continuation=16)
    kv = _reference_kv(model, _ids(tok, words(16, 40)))
    assert w.shape == (2, kv.num_layers, kv.num_kv_heads, kv.head_dim)
    assert torch.isfinite(w).all() and not torch.equal(w, torch.ones_like(w))
    engine = _engine(name, tok, level=1, store_options=[1], allow_text=False)
    engine.codec.step_weights = check_weights(w)
    prompt = words(17, 106)
    engine.generate(prompt, max_new_tokens=2)
    _, info = engine.generate(f"{prompt} {words(18, 12)}", max_new_tokens=4)
    assert info.cached_tokens >= 96 and set(info.levels) == {1} and not info.errors
