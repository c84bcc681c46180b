"""Document caches and partial chunks through the engine, on the tiny Llama: every reusable token reused."""

import math

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage

from cachegen_core.keys.chunks import blob_key
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.codec.config import CodecConfig
from cachegen_core.engine import KVEngine
from cachegen_core.engine.documents.blend import BlendConfig
from cachegen_core.keys.manifest import Manifest, manifest_key
from cachegen_core.keys.segments import SegmentedPrompt
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_llama, words
from langchain_cachegen import CacheGenLLM, ChatCacheGen, format_documents
from langchain_cachegen.documents import split_marked

DOCS = [words(40 + i, 90) for i in range(4)]


def _engine(model, tok, store=None, **kw) -> KVEngine:
    # text off: these tests count what the document caches and prefixes supply, and on the tiny model a stored piece
    # and its prefill tie; with the link measured slow (a fetch timed in a stall) pieces went as text (documents_reused fell)
    kw = {"chunk_tokens": 64, "level": "raw", "background": False, "partial_step": 16, "allow_text": False, **kw}
    return KVEngine(model, tok, store=store if store is not None else MemoryStore(), **kw)


def _prompt(engine: KVEngine, question: str, docs: list[str]) -> SegmentedPrompt:
    parts = [(f"context for {question}", False)]
    for d in docs:
        parts += [(d, True), ("next", False)]
    return engine.segment([*parts, (question, False)])


def _greedy(model, ids, n: int = 6) -> list[int]:
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, x.shape[1] :].tolist()


def _doc_blobs(engine: KVEngine, doc: str) -> list[str]:
    pieces = engine.documents.pieces(engine.tokenizer(doc, add_special_tokens=False)["input_ids"])
    return [blob_key(c.key, engine.level) for c in pieces]


def test_documents_in_another_order_and_combination_hit(tiny_llama, tiny_tokenizer):
    engine = _engine(tiny_llama, tiny_tokenizer)
    _, first = engine.generate(_prompt(engine, "q1", DOCS[:3]), max_new_tokens=2)
    assert first.documents == 3 and first.documents_reused == 0 and first.chunks_queued > 0  # computed, then stored
    prompt = _prompt(engine, "q2 is another question", [DOCS[2], DOCS[3], DOCS[0]])
    _, info = engine.generate(prompt, max_new_tokens=2)
    assert info.documents == 3 and info.documents_reused == 2  # DOCS[3] is new: computed in place
    assert info.blend_recomputed == 90 + 2 + math.ceil(0.15 * 180)  # the new document, the text between, 15 %
    assert info.cached_tokens == 180 - math.ceil(0.15 * 180)  # the two cached documents less what the blend redid
    _, again = engine.generate(_prompt(engine, "q3", [DOCS[3], DOCS[1], DOCS[2]]), max_new_tokens=2)
    assert again.documents_reused == 3 and not again.errors


def test_a_document_piece_is_coded_at_the_positions_it_was_computed_at(tiny_llama, tiny_tokenizer):
    engine = _engine(tiny_llama, tiny_tokenizer, level=0, store_options=[0])
    engine.store_documents(DOCS[:1])
    pieces = engine.documents.pieces(engine.tokenizer(DOCS[0], add_special_tokens=False)["input_ids"])
    assert len(pieces) > 1
    for c in pieces:  # after the preamble, as ``compute`` prefills it
        assert engine.codec.check(engine.store.get(blob_key(c.key, 0)), 0).header.start == len(engine.documents.preamble) + c.start


def test_recompute_ratio_one_answers_as_full_prefill(tiny_llama, tiny_tokenizer):
    engine = _engine(tiny_llama, tiny_tokenizer, blend=BlendConfig(recompute_ratio=1.0))
    engine.store_documents(DOCS[:2])
    prompt = _prompt(engine, "which one", [DOCS[1], DOCS[0]])
    text, info = engine.generate(prompt, max_new_tokens=6)
    assert info.documents_reused == 2 and info.blend_recomputed == 180 + 1  # every document token, and the text between
    assert engine.tokenizer(text, add_special_tokens=False)["input_ids"] == _greedy(tiny_llama, prompt.ids)


def test_ratio_zero_is_concatenation_and_differs_from_full_prefill_kv(tiny_llama, tiny_tokenizer, monkeypatch):
    from cachegen_core.engine.documents import documents

    def no_pass(*args, **kwargs):
        raise AssertionError("nothing to pick: the question's pass is not run")

    monkeypatch.setattr(documents, "question_attention", no_pass)
    engine = _engine(tiny_llama, tiny_tokenizer, blend=BlendConfig(recompute_ratio=0.0))
    engine.store_documents(DOCS[:2])
    _, info = engine.generate(_prompt(engine, "which one", [DOCS[1], DOCS[0]]), max_new_tokens=2)
    assert info.documents_reused == 2 and info.blend_recomputed == 1 and info.cached_tokens == 180


def test_the_blend_recomputes_the_last_document_first(tiny_llama, tiny_tokenizer):
    kvs = {}
    for name, config in (("concat", BlendConfig(recompute_ratio=0.0)), ("last", BlendConfig(recompute_ratio=0.5, select="last_document")),
                         ("deviation", BlendConfig(recompute_ratio=0.5, select="deviation")),
                         ("epic", BlendConfig(recompute_ratio=0.5, select="document_starts"))):  # fmt: skip
        engine = _engine(tiny_llama, tiny_tokenizer, blend=config)
        engine.store_documents(DOCS[:2])
        prompt = _prompt(engine, "which one", [DOCS[1], DOCS[0]])
        kvs[name], info = engine.prompt_kv(prompt)
        assert info.documents_reused == 2
    (s0, e0), (s1, e1) = prompt.documents
    concat, last = kvs["concat"], kvs["last"]
    # a budget of ceil(0.5 * 180) = 90 tokens is the whole last document: the first keeps its cached KV, bit for bit
    assert torch.equal(last.keys[:, :, s0:e0], concat.keys[:, :, s0:e0]) and torch.equal(last.values[:, :, s0:e0], concat.values[:, :, s0:e0])
    assert (last.values[-1, :, s1:e1] != concat.values[-1, :, s1:e1]).any(-1).any(0).all()  # every token of it recomputed
    assert not torch.equal(kvs["deviation"].values[:, :, s0:e0], concat.values[:, :, s0:e0])  # deviation alone: both
    epic = kvs["epic"]  # EPIC's pick: the first 45 tokens of each document, nothing else
    for s, e in prompt.documents:
        changed = (epic.values[-1, :, s:e] != concat.values[-1, :, s:e]).any(-1).any(0)
        assert changed[:45].all() and not changed[45:].any()


def test_the_prefix_before_the_documents_is_stored_and_reused_exactly(tiny_llama, tiny_tokenizer):
    engine = _engine(tiny_llama, tiny_tokenizer, allow_text=False)  # tiny model: text and fetching tie, picked by timings
    lead = words(60, 100)
    engine.generate(engine.segment([(lead, False), (DOCS[0], True), ("q", False)]), max_new_tokens=2)
    _, info = engine.generate(engine.segment([(lead, False), (DOCS[1], True), ("q", False)]), max_new_tokens=2)
    assert info.partial_tokens == 100 + 1 - 64 - (100 + 1 - 64) % 16  # the chunk of 64, then a 32-token partial
    assert info.levels == ["raw", "raw"]


@pytest.mark.parametrize("variant", ["model", "codec"])
def test_document_caches_of_another_model_or_codec_are_never_used(tiny_llama, tiny_tokenizer, variant):
    store = MemoryStore()
    _engine(tiny_llama, tiny_tokenizer, store).store_documents(DOCS[:2])
    if variant == "model":
        other = _engine(make_tiny_llama(seed=1), tiny_tokenizer, store)
    else:
        other = _engine(tiny_llama, tiny_tokenizer, store, codec=KVCodec(CodecConfig(sink_tokens=4)), level=0, store_options=[0])
    _, info = other.generate(_prompt(other, "q", DOCS[:2]), max_new_tokens=2)
    assert info.documents == 2 and info.documents_reused == 0 and info.cached_tokens == 0


def test_a_document_blob_under_another_models_key_is_rejected(tiny_llama, tiny_tokenizer):
    """Keys bind model and codec; so does every blob: a blob copied under another engine's key never decodes."""
    store = MemoryStore()
    mine = _engine(tiny_llama, tiny_tokenizer, store)
    mine.store_documents(DOCS[:1])
    other = _engine(make_tiny_llama(seed=1), tiny_tokenizer, store)
    other.store_documents(DOCS[:1])
    for a, b in zip(_doc_blobs(mine, DOCS[0]), _doc_blobs(other, DOCS[0])):
        store.put(b, store.get(a))
    prompt = _prompt(other, "q", DOCS[:1])
    text, info = other.generate(prompt, max_new_tokens=6)
    assert info.documents_reused == 0 and any("document piece" in e for e in info.errors)
    assert other.tokenizer(text, add_special_tokens=False)["input_ids"] == _greedy(other.model, prompt.ids)


def test_a_corrupted_document_blob_degrades_to_recompute(tiny_llama, tiny_tokenizer):
    engine = _engine(tiny_llama, tiny_tokenizer)
    engine.store_documents(DOCS[:1])
    key = _doc_blobs(engine, DOCS[0])[0]
    blob = bytearray(engine.store.get(key))
    blob[len(blob) // 2] ^= 0xFF
    engine.store.put(key, bytes(blob))
    prompt = _prompt(engine, "q", DOCS[:1])
    text, info = engine.generate(prompt, max_new_tokens=6)
    assert info.documents_reused == 0 and any("bad blob" in e for e in info.errors)
    assert engine.tokenizer(text, add_special_tokens=False)["input_ids"] == _greedy(tiny_llama, prompt.ids)


def test_a_short_prompt_is_reused_by_the_next_prompt_extending_it(tiny_llama, tiny_tokenizer):
    engine = _engine(tiny_llama, tiny_tokenizer, chunk_tokens=1536)
    first = words(61, 50)
    engine.generate(first, max_new_tokens=2)
    _, info = engine.generate(first + " " + words(62, 20), max_new_tokens=2)
    assert info.cached_tokens == 48 and info.partial_tokens == 48  # BOS + 50 words, rounded down to 16s
    _, off = _engine(tiny_llama, tiny_tokenizer, chunk_tokens=1536, partial_step=0).generate(first, max_new_tokens=2)
    assert off.cached_tokens == 0


@pytest.mark.parametrize("background", [False, True])
def test_a_partial_chunk_a_longer_one_extends_keeps_only_its_level(tiny_llama, tiny_tokenizer, background):
    """Its raw form was the next turn's fast path; once extended, the level alone stays (4x less space) and a prompt
    branching off it (a regenerated or edited turn) still reuses it, from the level."""
    store = MemoryStore()
    engine = _engine(tiny_llama, tiny_tokenizer, store, chunk_tokens=1536, level=1, store_options=["raw", 1],
                     allow_text=False, background=background)  # fmt: skip
    first = words(61, 50)
    engine.generate(first, max_new_tokens=2)
    _, info = engine.generate(first + " " + words(62, 20), max_new_tokens=2)
    assert engine.flush(30) and info.partial_tokens == 48 and info.levels == ["raw"]
    old, new = (engine._partials(engine.tokenize(p))(0)[-1] for p in (first, first + " " + words(62, 20)))
    assert (old.end, new.end) == (48, 64)
    assert Manifest.from_bytes(store.get(manifest_key(old.key))).options == [1]
    assert store.get(blob_key(old.key, "raw")) is None and store.get(blob_key(old.key, 1)) is not None
    assert Manifest.from_bytes(store.get(manifest_key(new.key))).options == ["raw", 1]
    _, branch = engine.generate(first + " " + words(63, 20), max_new_tokens=2)
    assert branch.partial_tokens == 48 and branch.levels == [1] and not branch.errors


@pytest.mark.parametrize("level", [0, "raw"])
def test_a_partial_chunk_keeps_its_raw_form_without_a_level_as_fine_as_the_engines(tiny_llama, tiny_tokenizer, level):
    store = MemoryStore()
    options = ["raw", 1] if level == 0 else ["raw"]  # level 1 is coarser than the engine's 0: dropping raw would lose it
    engine = _engine(tiny_llama, tiny_tokenizer, store, chunk_tokens=1536, level=level, store_options=options)
    first = words(61, 50)
    engine.generate(first, max_new_tokens=2)
    engine.generate(first + " " + words(62, 20), max_new_tokens=2)
    old = engine._partials(engine.tokenize(first))(0)[-1]
    assert Manifest.from_bytes(store.get(manifest_key(old.key))).options == options
    assert store.get(blob_key(old.key, "raw")) is not None


def test_a_chats_next_turn_recomputes_only_what_it_added(tiny_llama, tiny_tokenizer, tmp_path, monkeypatch):
    """Default engine settings (1536-token chunks, 64-token partial steps, background writer, disk store)."""
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path))
    chat = ChatCacheGen(llm=CacheGenLLM(engine=KVEngine(tiny_llama, tiny_tokenizer), generation_kwargs={"max_new_tokens": 4}))
    history = [SystemMessage(words(80, 1000)), HumanMessage(words(81, 30))]
    last = 0
    for turn in range(4):
        answer = chat.invoke(history)
        meta = answer.response_metadata
        if turn:
            added = meta["prompt_tokens"] - last
            assert meta["recomputed_tokens"] <= added + 64 and meta["cached_tokens"] >= last - 64
        last = meta["prompt_tokens"]
        history += [answer, HumanMessage(words(82 + turn, 300))]  # crosses the 1536-token chunk boundary
    assert last > 1536
    chat.engine.flush()


def test_format_documents_marks_each_document_and_the_llm_splits_them(tiny_llama, tiny_tokenizer):
    text = format_documents([Document(page_content=DOCS[0]), DOCS[1]])
    assert [d for _, d in split_marked(f"before {text} after")] == [False, True, False, True, False]
    llm = CacheGenLLM(engine=_engine(tiny_llama, tiny_tokenizer), generation_kwargs={"max_new_tokens": 2})
    llm.invoke(f"q {text} a")
    result = llm.generate([f"other {format_documents([DOCS[1], DOCS[0]])} b"])
    info = result.generations[0][0].generation_info
    assert info["documents"] == 2 and info["documents_reused"] == 2


def test_prompt_kv_builds_the_kv_a_request_would_use(tiny_llama, tiny_tokenizer):
    prompt_of = lambda e: _prompt(e, "q", [DOCS[1], DOCS[0]])  # noqa: E731
    full = _engine(tiny_llama, tiny_tokenizer, blend=None)
    exact, _ = full.prompt_kv(prompt_of(full))
    for ratio, close in ((1.0, True), (0.0, False)):
        engine = _engine(tiny_llama, tiny_tokenizer, blend=BlendConfig(recompute_ratio=ratio))
        engine.store_documents(DOCS[:2])
        kv, info = engine.prompt_kv(prompt_of(engine))
        assert info.documents_reused == 2 and kv.num_tokens == exact.num_tokens
        assert torch.allclose(kv.values, exact.values, atol=1e-2) is close  # the raw form: 16-bit


@pytest.mark.parametrize("face", ["llm", "chat"])
def test_documents_cached_at_indexing_leave_the_first_question_only_the_blends_share(tiny_llama, tiny_tokenizer, face):
    def ask(model, docs):
        context = format_documents(docs)
        if face == "llm":
            return model.generate([f"w7 {context} w8 w9"]).generations[0][0].generation_info
        return model.invoke([SystemMessage(f"w7 {context}"), HumanMessage("w8 w9")]).response_metadata

    def model_of(engine):
        llm = CacheGenLLM(engine=engine, generation_kwargs={"max_new_tokens": 2})
        return llm if face == "llm" else ChatCacheGen(llm=llm)

    docs = [Document(page_content=d, metadata={"id": i}) for i, d in enumerate(DOCS)]
    model = model_of(_engine(tiny_llama, tiny_tokenizer))
    done = model.cache_documents([*docs, "w10 w11"])  # the last one is too short to be a document cache
    assert (done.stored, done.already_cached, done.skipped, done.tokens) == (docs, [], ["w10 w11"], 4 * 90)
    again = model.cache_documents([DOCS[1], docs[2]])
    assert (again.stored, again.already_cached) == ([], [DOCS[1], docs[2]])
    info = ask(model, [docs[3], docs[0], docs[2]])  # the first question after indexing
    assert info["documents"] == info["documents_reused"] == 3 and not info["errors"]
    picked = math.ceil(0.15 * 270)  # the blend's share of the 270 document tokens
    assert info["cached_tokens"] == 270 - picked and info["recomputed_tokens"] == info["prompt_tokens"] - 270 + picked
    cold = ask(model_of(_engine(tiny_llama, tiny_tokenizer)), [docs[3], docs[0], docs[2]])  # without indexing
    assert cold["documents_reused"] == 0 and cold["cached_tokens"] == 0


def test_the_blend_presets(tiny_llama, tiny_tokenizer):
    from cachegen_core.engine.documents.blend import PRESETS

    assert _engine(tiny_llama, tiny_tokenizer).blend == PRESETS["fast"] == BlendConfig(recompute_ratio=PRESETS["fast"].recompute_ratio)
    balanced = _engine(tiny_llama, tiny_tokenizer, blend="balanced").blend
    assert balanced.recompute_ratio > PRESETS["fast"].recompute_ratio
    with pytest.raises(ValueError, match="balanced.*exact.*fast"):
        _engine(tiny_llama, tiny_tokenizer, blend="best")
    exact = CacheGenLLM(engine=_engine(tiny_llama, tiny_tokenizer, blend="exact"), generation_kwargs={"max_new_tokens": 6})
    assert exact.engine.documents is None and exact.cache_documents(DOCS[:2]).skipped == DOCS[:2]
    prompt = _prompt(exact.engine, "q", [DOCS[1], DOCS[0]])
    info = exact.engine.generate(prompt, max_new_tokens=6)[1]
    assert info.documents_reused == 0 and info.cached_tokens == 0  # documents are plain text: nothing blended
    _, again = exact.engine.generate(prompt, max_new_tokens=6)
    assert again.cached_tokens > 0 and again.blend_recomputed == 0  # the same prompt again: its stored prefix, exact
