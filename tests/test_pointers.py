"""A plain-text prompt reuses the stored tail as far as it agrees with it (issue 54): pointers to partial chunks.

A prompt whose next question starts inside a stored partial chunk's last steps finds it through the pointer the
writer left under its own prefix's key (``keys/pointers.py``), checked against its own tokens, and takes that
chunk's first tokens: it answers as without a cache. A bad pointer or a pointed chunk gone is a miss.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from cachegen_core.cli import main
from cachegen_core.engine import KVEngine
from cachegen_core.engine.chunks.tails import decode_borrowed
from cachegen_core.errors import CacheGenFormatError, StoreError
from cachegen_core.keys.chunks import PartialChunk, blob_key, chunk_keys, partial_chunks
from cachegen_core.keys.manifest import Manifest, manifest_key
from cachegen_core.keys.pointers import MAX_POINTERS, MAX_SUFFIX_TOKENS, Borrowed, Pointer, follow, pointer_key, pointers
from cachegen_core.kv import KVCache
from cachegen_core.stores import DiskCacheStore
from cachegen_core.stores.admin import GcPolicy, gc, stats
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.stores.signed import SignedStore
from cachegen_core.testing import words
from langchain_cachegen import CacheGenLLM, ChatCacheGen
from langchain_cachegen.chat_template import render_prompt

CHUNK, STEP, NEW = 64, 16, 6
IDS = {"fingerprint": "fp", "codec_id": "codec", "profile_id": "prof"}


def _engine(model, tok, **kw) -> KVEngine:
    kw = {"store": MemoryStore(), "chunk_tokens": CHUNK, "partial_step": STEP, "level": "lossless", "background": False, **kw}
    return KVEngine(model, tok, **kw)


def _llm(model, tok, **kw) -> CacheGenLLM:
    return CacheGenLLM(engine=_engine(model, tok, **kw), max_tokens=NEW)


def _agree(a, b) -> int:
    """How many leading tokens two prompts share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _reusable(agree: int, stored: int) -> int:
    """What a prompt agreeing with a stored prompt for ``agree`` tokens may reuse: its complete chunks, then its partial
    chunk to the last step, up to the stored partial chunk's end ``stored``."""
    return min(agree - agree % CHUNK % STEP, stored)


def _tail(ids) -> PartialChunk:
    return partial_chunks(ids, len(ids) - len(ids) % CHUNK, chunk_tokens=CHUNK, step=STEP, **IDS)[-1]  # type: ignore[return-value]


# ------------------------------------------------------------------ keys
def test_partial_keys_follow_the_documented_layout_and_extend():
    ids = list(range(7, 7 + 150))
    parts = partial_chunks(ids, 128, chunk_tokens=CHUNK, step=STEP, **IDS)
    assert [c.end for c in parts] == [144]
    h = hashlib.blake2b(digest_size=32, person=b"cachegen-tailv1")
    for field in ("fp", "codec", "prof", str(CHUNK), str(STEP)):
        h.update(len(field).to_bytes(8, "little") + field.encode())
    h.update(np.asarray(ids[:144], dtype="<u4").tobytes())
    assert parts[0].key == h.hexdigest() and parts[0].key not in {c.key for c in chunk_keys(ids, chunk_tokens=CHUNK, **IDS)}
    first = partial_chunks(ids, 0, chunk_tokens=CHUNK, step=STEP, **IDS)
    assert [c.end for c in first] == [16, 32, 48] and first[2].shorter == ((16, first[0].key), (32, first[1].key))
    assert first[0].extended(np.asarray(ids[16:48], dtype="<u4")) == first[2].key
    assert list(first[2].tokens) == ids[:48]


def test_a_pointer_round_trips_and_is_parsed_strictly():
    p = Pointer("ab" * 32, 48, np.arange(5, 21, dtype="<u4"))
    back = Pointer.from_bytes(p.to_bytes())
    assert (back.chunk, back.tokens, list(back.suffix)) == (p.chunk, 48, list(range(5, 21)))
    good = {"format": "cachegen-pointer-v1", "chunk": "ab" * 32, "tokens": 48, "suffix": "BQAAAA=="}
    bad = [b"{not json", b"[]", b"\xff", b"x" * 40000, {**good, "format": "cachegen-manifest-v1"}, {**good, "more": 1},
           {**good, "chunk": "AB" * 32}, {**good, "chunk": "ab" * 31}, {**good, "tokens": True}, {**good, "tokens": 0},
           {**good, "tokens": 48.0}, {**good, "suffix": ""}, {**good, "suffix": "BQAA"}, {**good, "suffix": "BQ AAAA=="},
           {**good, "suffix": 5}]  # fmt: skip
    assert Pointer.from_bytes(json.dumps(good).encode()).tokens == 48
    for b in bad:
        with pytest.raises(CacheGenFormatError):
            Pointer.from_bytes(b if isinstance(b, bytes) else json.dumps(b).encode())


def test_a_partial_chunk_is_pointed_at_from_each_shorter_prefix_and_a_pointer_proves_its_tokens():
    ids = [int(i) for i in np.random.default_rng(0).integers(7, 120, 60)]
    tail = _tail(ids)
    entries = pointers(tail)
    shorter = partial_chunks(ids, 0, chunk_tokens=CHUNK, step=STEP, **IDS)[:2]
    assert tail.end == 48 and [k for k, _ in entries] == [pointer_key(shorter[1].key), pointer_key(shorter[0].key)]
    b = follow(shorter[1], entries[0][1])
    assert isinstance(b, Borrowed) and (b.start, b.end, b.key, b.source, b.source_end) == (0, 32, shorter[1].key, tail.key, 48)
    assert (b.stored.key, b.stored.end, shorter[1].stored) == (tail.key, 48, shorter[1])
    other = partial_chunks([ids[0] + 1, *ids[1:]], 0, chunk_tokens=CHUNK, step=STEP, **IDS)[1]  # same length, other tokens
    with pytest.raises(CacheGenFormatError, match="other tokens"):
        follow(other, entries[0][1])
    with pytest.raises(CacheGenFormatError, match="tokens under the key"):  # moved under another prefix's key
        follow(shorter[0], entries[0][1])
    assert pointers(chunk_keys(ids, chunk_tokens=16, **IDS)[0]) == []  # complete chunks have none
    long = partial_chunks(list(range(9000)), 0, chunk_tokens=9000, step=1, **IDS)[-1]
    assert len(pointers(long)) == MAX_POINTERS
    wide = partial_chunks(list(range(9000)), 0, chunk_tokens=9000, step=1024, **IDS)[-1]  # 8 steps: back at most 4096
    assert [len(Pointer.from_bytes(v).suffix) for _, v in pointers(wide)] == [1024 * j for j in range(1, MAX_SUFFIX_TOKENS // 1024 + 1)]


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("context, first_question", [(90, 10), (85, 40), (40, 10)])
def test_a_plain_prompts_next_question_reuses_the_stored_tail_as_far_as_they_agree(tiny_llama, tiny_tokenizer, context,
                                                                                   first_question):  # fmt: skip
    """(90, 10): the second question starts inside the stored partial chunk's last step (the issue's case: none of
    it was reused); (85, 40): two steps before its end; (40, 10): a prompt shorter than a chunk."""
    llm, fresh = _llm(tiny_llama, tiny_tokenizer), _llm(tiny_llama, tiny_tokenizer)
    ctx = words(1, context)
    first, second = f"{ctx} {words(2, first_question)}", f"{ctx} {words(3, 12)}"
    ids1, ids2 = llm.engine.tokenize(first), llm.engine.tokenize(second)
    stored = len(ids1) - len(ids1) % CHUNK % STEP
    agree = _agree(ids1, ids2)
    assert agree < stored and agree - agree % CHUNK % STEP > agree - agree % CHUNK  # a pointer is needed, and there is one
    llm.invoke(first)
    info = llm.generate([second]).generations[0][0].generation_info
    assert info["cached_tokens"] == _reusable(agree, stored) and info["partial_tokens"] == _reusable(agree, stored) % CHUNK
    assert not info["errors"]
    assert llm.invoke(second) == fresh.invoke(second)  # lossless: as without a cache


def test_default_settings_reuse_it_from_the_hot_tier_and_from_the_store(tiny_llama, tiny_tokenizer, tmp_path, monkeypatch):
    """1536-token chunks, 64-token steps, a background writer, the disk store: the next question finds the pointers
    before the writer has stored them (its hot tier), and another engine finds them once stored."""
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path))
    engine = KVEngine(tiny_llama, tiny_tokenizer)
    ctx = words(5, 1100)
    first, second = f"{ctx} {words(6, 60)}", f"{ctx} {words(7, 60)}"
    engine.generate(first, max_new_tokens=2)
    _, info = engine.generate(second, max_new_tokens=2)
    agree = _agree(engine.tokenize(first), engine.tokenize(second))
    assert info.cached_tokens == agree - agree % 64 == 1088 and info.partial_tokens == 1088 and not info.errors
    assert engine.flush(60)
    other = KVEngine(tiny_llama, tiny_tokenizer)
    _, again = other.generate(f"{ctx} {words(8, 20)}", max_new_tokens=2)  # through the second's pointers: no tail of 1088
    assert again.cached_tokens == 1088 and not again.errors
    engine.close()
    other.close()


def test_a_chats_edited_turn_reuses_the_history_up_to_the_edit(tiny_llama, tiny_tokenizer):
    chat = ChatCacheGen(llm=_llm(tiny_llama, tiny_tokenizer))
    history = [SystemMessage(words(30, 60)), HumanMessage(words(31, 8))]
    history += [AIMessage(chat.invoke(history).content), HumanMessage(words(32, 20))]
    chat.invoke(history)
    edited = [*history[:-1], HumanMessage(words(33, 20))]
    ids, ids2 = list(render_prompt(tiny_tokenizer, history)), list(render_prompt(tiny_tokenizer, edited))
    agree, stored = _agree(ids, ids2), len(ids) - len(ids) % CHUNK % STEP
    assert agree // CHUNK == stored // CHUNK and agree < stored  # the edit starts inside the stored tail
    reply = chat.invoke(edited)
    assert reply.response_metadata["cached_tokens"] == _reusable(agree, stored) > agree - agree % CHUNK
    assert reply.content == ChatCacheGen(llm=_llm(tiny_llama, tiny_tokenizer)).invoke(edited).content


def _stored_pair(llm):
    """A first prompt asked and stored (its tail ends at 112), a second one agreeing with it for 105 tokens: the
    second, the first's tail and the second's partial chunk at the last step where they agree (96)."""
    ctx = words(1, 105)
    first, second = f"{ctx} {words(2, 10)}", f"{ctx} {words(3, 12)}"
    llm.invoke(first)
    ids1, ids2 = llm.engine.tokenize(first), llm.engine.tokenize(second)
    tail, prefix = llm.engine._partials(ids1)(CHUNK)[-1], llm.engine._partials(ids2)(CHUNK)[1]
    assert (_agree(ids1, ids2), tail.end, prefix.end) == (105, 112, 96)
    return second, tail, prefix


@pytest.mark.parametrize("bad", ["malformed", "forged", "moved"])
def test_a_bad_pointer_is_reported_and_recomputed(tiny_llama, tiny_tokenizer, bad):
    llm = _llm(tiny_llama, tiny_tokenizer)
    store = llm.engine.store
    second, tail, prefix = _stored_pair(llm)
    assert store.get(pointer_key(prefix.key)) is not None
    if bad == "malformed":
        value = b'{"format": "cachegen-pointer-v1"'
    elif bad == "forged":  # another stored chunk as long, under this prefix's key: well formed, but of other tokens
        llm.invoke(words(4, 115))
        other = llm.engine._partials(llm.engine.tokenize(words(4, 115)))(CHUNK)[-1]
        assert other.end == tail.end
        value = Pointer(other.key, prefix.num_tokens, other.tokens[prefix.num_tokens :]).to_bytes()
    else:  # the genuine pointer under the shorter prefix's key, moved here
        value = store.get(pointer_key(llm.engine._partials(llm.engine.tokenize(second))(CHUNK)[0].key))
    store.put(pointer_key(prefix.key), value)
    info = llm.generate([second]).generations[0][0].generation_info
    assert any("bad pointer" in e for e in info["errors"])
    assert info["cached_tokens"] == prefix.end - STEP  # the shorter prefix's pointer still holds
    assert llm.invoke(second) == _llm(tiny_llama, tiny_tokenizer).invoke(second)


def test_a_pointed_chunk_gone_is_a_plain_miss(tiny_llama, tiny_tokenizer):
    llm = _llm(tiny_llama, tiny_tokenizer)
    second, tail, _ = _stored_pair(llm)
    llm.engine.store.delete_many([manifest_key(tail.key), blob_key(tail.key, "lossless")])  # evicted
    info = llm.generate([second]).generations[0][0].generation_info
    assert info["cached_tokens"] == CHUNK and not info["errors"]
    assert llm.invoke(second) == _llm(tiny_llama, tiny_tokenizer).invoke(second)


def test_a_pointed_chunk_without_its_raw_form_is_taken_at_its_level(tiny_llama, tiny_tokenizer):
    llm = _llm(tiny_llama, tiny_tokenizer, level=1, store_options=["raw", 1], allow_text=False)
    second, tail, _ = _stored_pair(llm)
    llm.engine.store.delete(blob_key(tail.key, "raw"))  # the raw tier evicted it; the manifest still names it
    _, info = llm.engine.generate(second, max_new_tokens=2)
    assert info.cached_tokens == 96 and info.levels[-1] == 1 and not info.errors


def test_a_borrowing_prompt_leaves_the_pointed_chunk_its_raw_form(tiny_llama, tiny_tokenizer):
    """It branched off the pointed chunk, extending none of it: nothing is superseded; its own tail is stored, and its
    pointers now lead to it."""
    llm = _llm(tiny_llama, tiny_tokenizer, level=1, store_options=["raw", 1], allow_text=False)
    store, engine = llm.engine.store, llm.engine
    second, tail, prefix = _stored_pair(llm)
    _, info = engine.generate(second, max_new_tokens=2)
    assert info.cached_tokens == prefix.end and info.chunks_queued == 1
    assert Manifest.from_bytes(store.get(manifest_key(tail.key))).options == ["raw", 1]
    assert not engine.writer.drop_raw(prefix, 1) and store.get(manifest_key(prefix.key)) is None
    own = engine._partials(engine.tokenize(second))(CHUNK)[-1]
    assert Pointer.from_bytes(store.get(pointer_key(prefix.key))).chunk == own.key


def test_a_store_refusing_pointers_still_stores_the_chunk_and_its_levels(tiny_llama, tiny_tokenizer):
    class NoPointers(MemoryStore):
        def put_many(self, items):
            items = list(items.items() if isinstance(items, dict) else items)
            if any(k.endswith("-P") for k, _ in items):
                raise StoreError("refused")
            super().put_many(items)

    llm = _llm(tiny_llama, tiny_tokenizer, store=NoPointers(), level=1, store_options=["raw", 1], background=True)
    second, tail, prefix = _stored_pair(llm)
    store = llm.engine.store
    assert llm.engine.flush(30) and llm.engine.store_stats["failed"] == 0  # levels are a later stage: written too
    assert Manifest.from_bytes(store.get(manifest_key(tail.key))).options == ["raw", 1] and store.get(pointer_key(prefix.key)) is None
    _, info = llm.engine.generate(second, max_new_tokens=2)
    assert info.cached_tokens == CHUNK and not info.errors  # no pointer: the complete chunk only, as before


@pytest.mark.parametrize("room", [True, False])
def test_a_borrowed_chunk_is_the_stored_chunks_first_tokens_with_or_without_room_past_it(tiny_llama, tiny_tokenizer, room):
    llm = _llm(tiny_llama, tiny_tokenizer)
    engine = llm.engine
    _, tail, prefix = _stored_pair(llm)
    borrowed = follow(prefix, engine.store.get(pointer_key(prefix.key)))
    blob = engine.reader.fetch(borrowed.source, "lossless")
    whole = engine.reader.decode(blob, tail.key, "lossless")
    buffer = engine.buffers.take(tail.end + 8 if room else prefix.end)
    buffer = buffer.slice(0, tail.end + 8 if room else prefix.end)
    got = decode_borrowed(engine.reader, blob, borrowed, "lossless", buffer)
    assert got.num_tokens == prefix.end - CHUNK
    assert torch_equal(got, whole.slice(0, prefix.end - CHUNK))  # lossless: the very values


def torch_equal(a: KVCache, b: KVCache) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_batch_borrows_one_stored_chunk_for_two_prompts(tiny_llama, tiny_tokenizer):
    llm = _llm(tiny_llama, tiny_tokenizer)
    ctx = words(1, 90)
    llm.invoke(f"{ctx} {words(2, 10)}")
    prompts = [f"{ctx} {words(3, 12)}", f"{ctx} {words(9, 7)}"]
    out = llm.engine.generate_many(prompts, max_new_tokens=NEW)
    assert [i.cached_tokens for _, i in out] == [80, 80] and not any(i.errors for _, i in out)
    fresh = _engine(tiny_llama, tiny_tokenizer)
    assert [t for t, _ in out] == [fresh.generate(p, max_new_tokens=NEW)[0] for p in prompts]


# ------------------------------------------------------------------ stats, gc, ls, inspect
def _pointed_store(tiny_llama, tiny_tokenizer, store):
    """A tail of 48 tokens after a complete chunk (its pointers under the prefixes of 16 and 32) and its keys."""
    llm = _llm(tiny_llama, tiny_tokenizer, store=store, level=1, store_options=["raw", 1])
    llm.invoke(words(1, 115))
    tail = llm.engine._partials(llm.engine.tokenize(words(1, 115)))(CHUNK)[-1]
    return llm, tail, [k for k, _ in pointers(tail)]


def test_stats_and_gc_count_pointers_apart_and_delete_those_whose_chunk_goes(tiny_llama, tiny_tokenizer, tmp_path, capsys):
    d = str(tmp_path / "kv")
    llm, tail, keys = _pointed_store(tiny_llama, tiny_tokenizer, DiskCacheStore(d))
    store = llm.engine.store
    assert len(keys) == 2 and all(store.get(k) is not None for k in keys)
    s = stats(store, headers=False)
    sizes = [len(store.get(k)) for k in keys]
    assert (s["chunks"], s["pointers"], s["pointer_bytes"], s["chunks_without_manifest"], s["other_keys"]) == (2, 2, sum(sizes), 0, 0)
    assert s["entries"] == 2 * 3 + 2 and s["bytes"] == sum(len(store.get(k)) for k in store.keys())
    assert s["tiers"]["capacity"]["entries"] == 2 * 2 + 2  # manifests, levels, pointers
    assert sizes == [len(v) for _, v in pointers(tail)] and max(sizes) < 140 + 4 * 4 / 3 * 32  # 16 and 32 tokens of suffix, base64

    assert main(["ls", d, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(r["pointer"] for r in rows if "pointer" in r) == sorted(k[:-2] for k in keys)
    assert main(["ls", d]) == 0
    assert "2 chunks (0 without a manifest), 2 pointers, 0 other keys" in capsys.readouterr().out
    assert main(["inspect", d, keys[0]]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["pointer"] == {"chunk": tail.key, "tokens": 32, "suffix_tokens": 16}
    assert main(["inspect", d, keys[1][:12]]) == 0  # by the id it is under
    shown = json.loads(capsys.readouterr().out)
    assert shown["chunk"] == keys[1][:-2] and shown["manifest"] is None and shown["pointer"]["tokens"] == 16

    assert gc(store, GcPolicy(orphans=True))["pointers_deleted"] == 0  # their chunk is there
    r = gc(store, GcPolicy(max_bytes=s["bytes"] - 1), dry_run=True)  # the oldest unit goes first, a chunk or a pointer
    assert r["chunks_deleted"] + r["pointers_deleted"] >= 1 and r["bytes_left"] < s["bytes"]
    store.delete(manifest_key(tail.key))  # the tail evicted (its blobs left: an orphan chunk)
    r = gc(store, GcPolicy(orphans=True, orphan_grace_s=0))
    assert (r["pointers_deleted"], r["pointers_by_reason"], r["by_reason"]) == (2, {"dangling": 2}, {"orphan": 1})
    assert all(store.get(k) is None for k in keys) and stats(store, headers=False)["pointers"] == 0


def test_gc_of_a_model_deletes_the_pointers_to_its_chunks(tiny_llama, tiny_tokenizer):
    llm, tail, keys = _pointed_store(tiny_llama, tiny_tokenizer, SignedStore(MemoryStore(), b"k" * 32))
    store = llm.engine.store
    store.put(pointer_key("ab" * 32), b"not a pointer")  # unreadable: dangling
    r = gc(store, GcPolicy(orphans=True))  # signed pointers read without the key: their chunk is there
    assert (r["pointers_deleted"], r["pointers_left"], r["chunks_deleted"]) == (1, 2, 0)
    r = gc(store, GcPolicy(model=llm.engine.fingerprint[:12]))
    assert (r["chunks_deleted"], r["pointers_deleted"], r["pointers_left"]) == (2, 2, 0) and not list(store.keys())
    _, info = llm.engine.generate(words(1, 100) + " " + words(2, 9), max_new_tokens=1)
    assert info.cached_tokens == 0 and not info.errors
