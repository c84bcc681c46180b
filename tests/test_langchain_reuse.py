"""A question after the same context reuses the whole context (issue 47, item 3).

The chat model marks where the messages before its new turn end (``SegmentedPrompt.prefix_ends``), a prompt's
``format_documents`` documents end at the last one; the engine keeps a partial chunk ending there, so that a
second question after the same system message (a RAG chain's) recomputes only the question and the few tokens
the partial chunk's rounding leaves, and answers as without a cache.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from cachegen_core.engine import KVEngine
from cachegen_core.keys.manifest import Manifest, manifest_key
from cachegen_core.keys.segments import SegmentedPrompt, prefix_ends
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from langchain_cachegen import CacheGenLLM, ChatCacheGen, format_documents
from langchain_cachegen.chat_template import render_prompt

CHUNK, STEP, NEW = 64, 16, 6


def _engine(model, tok, **kw) -> KVEngine:
    kw = {"store": MemoryStore(), "chunk_tokens": CHUNK, "partial_step": STEP, "level": "lossless", "background": False, **kw}
    return KVEngine(model, tok, **kw)


def _chat(model, tok, **kw) -> ChatCacheGen:
    return ChatCacheGen(llm=CacheGenLLM(engine=_engine(model, tok, **kw), max_tokens=NEW))


def _rounded(end: int) -> int:
    """Where the partial chunk kept for a prefix ending at ``end`` ends."""
    return end - end % CHUNK % STEP


def test_the_prompt_marks_the_end_of_the_messages_before_the_new_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    system, q1, a1, q2 = SystemMessage(words(1, 20)), HumanMessage(words(2, 5)), AIMessage(words(3, 4)), HumanMessage(words(4, 5))
    assert not prefix_ends(render_prompt(tok, [q1]))  # nothing before the first question
    for history, before in (([system, q1], [system]), ([system, q1, a1, q2], [system, q1, a1])):
        prompt = render_prompt(tok, history)
        end = len(tok.apply_chat_template([{"role": m.type.replace("human", "user").replace("ai", "assistant"), "content": m.content}
                                           for m in before], tokenize=False).split())  # fmt: skip
        assert prompt.prefix_ends == (end,) and list(prompt)[:end] == list(render_prompt(tok, [*before, q2]))[:end]
    call = AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "c"}])
    with_tool = render_prompt(tok, [system, q1, call, ToolMessage(words(5, 3), tool_call_id="c")])
    assert with_tool.prefix_ends == render_prompt(tok, [system, q1, call, q2]).prefix_ends  # a tool result is a new turn too


def test_prefix_ends_are_checked():
    assert SegmentedPrompt((1, 2, 3), prefix_ends=(2, 3)).prefix_ends == (2, 3)
    for bad in ((0,), (4,), (3, 2), (2, 2)):
        with pytest.raises(ValueError, match="prefix ends"):
            SegmentedPrompt((1, 2, 3), prefix_ends=bad)


def test_a_second_question_after_the_same_system_message_recomputes_only_the_question(tiny_llama, tiny_tokenizer):
    chat = _chat(tiny_llama, tiny_tokenizer)
    system = SystemMessage(words(10, 150))
    for i, question in enumerate([words(11, 9), words(12, 14), words(13, 6)]):
        messages = [system, HumanMessage(question)]
        prompt = render_prompt(tiny_tokenizer, messages)
        reply = chat.invoke(messages)
        meta = reply.response_metadata
        assert reply.content == _chat(tiny_llama, tiny_tokenizer).invoke(messages).content  # as without a cache
        if i:  # the system message's tokens all come from the store but the partial chunk's rounding
            boundary = prompt.prefix_ends[0]
            assert meta["cached_tokens"] == _rounded(boundary) and boundary - _rounded(boundary) < STEP
            assert meta["recomputed_tokens"] == len(prompt) - _rounded(boundary) < len(prompt) - boundary + STEP


def test_a_prefix_and_a_prompt_ending_in_the_same_partial_chunk_store_it_once(tiny_llama, tiny_tokenizer):
    chat = _chat(tiny_llama, tiny_tokenizer)
    messages = [SystemMessage(words(15, 145)), HumanMessage(words(16, 3))]
    prompt = render_prompt(tiny_tokenizer, messages)
    assert _rounded(prompt.prefix_ends[0]) == _rounded(len(prompt)) > 2 * CHUNK  # one partial chunk ends both
    assert chat.invoke(messages).response_metadata["chunks_queued"] == 2 + 1  # two complete chunks and that one


def test_the_shared_partial_chunk_keeps_its_raw_form(tiny_llama, tiny_tokenizer):
    """A question that extends the shared partial chunk does not supersede it: the next one still streams it raw."""
    chat = _chat(tiny_llama, tiny_tokenizer, level=1, store_options=["raw", 1])
    engine = chat.engine
    system = SystemMessage(words(20, 150))
    for question in (words(21, 9), words(22, 9), words(23, 9)):
        chat.invoke([system, HumanMessage(question)])
    prompt = render_prompt(tiny_tokenizer, [system, HumanMessage(question)])
    end = _rounded(prompt.prefix_ends[0])
    shared = engine._partials(list(prompt)[:end])(end - end % CHUNK)[-1]
    assert shared.end == end and "raw" in Manifest.from_bytes(engine.store.get(manifest_key(shared.key))).options


def test_a_chats_next_turns_reuse_all_but_the_last_few_tokens_and_store_one_tail_each(tiny_llama, tiny_tokenizer):
    chat = _chat(tiny_llama, tiny_tokenizer)
    history: list = [SystemMessage(words(30, 100)), HumanMessage(words(31, 8))]
    last = 0
    for turn in range(5):
        prompt = render_prompt(tiny_tokenizer, history)
        reply = chat.invoke(history)
        meta = reply.response_metadata
        if turn:  # everything the previous turn's prompt held, to the partial chunk's rounding
            assert meta["recomputed_tokens"] <= len(prompt) - last + STEP
            completed = len(prompt) // CHUNK - last // CHUNK  # complete chunks this turn computed
            assert meta["chunks_queued"] <= completed + 1  # and one tail: a continued chat keeps no prefix's chunk
        last = len(prompt)
        history += [AIMessage(reply.content), HumanMessage(words(40 + turn, 7))]


def test_a_second_question_after_the_same_documents_without_blend(tiny_llama, tiny_tokenizer):
    """``format_documents`` documents end a shared prefix too: with ``blend="exact"`` (documents as plain text) the
    next question after the same instructions and documents recomputes only the question."""
    llm = CacheGenLLM(engine=_engine(tiny_llama, tiny_tokenizer, blend="exact"), max_tokens=NEW)
    context = format_documents([words(50, 70), words(51, 70)])
    for i, question in enumerate([words(52, 12), words(53, 11)]):  # the first one's tail chunk ends past its question's start
        text = f"{words(54, 10)} {context} {question}"
        info = llm.generate([text]).generations[0][0].generation_info
        fresh = CacheGenLLM(engine=_engine(tiny_llama, tiny_tokenizer, blend="exact"), max_tokens=NEW)
        assert llm.invoke(text) == fresh.invoke(text)
        if i:
            end = 10 + 70 + 70  # the last document's end (the tokenizer adds no BOS)
            assert info["cached_tokens"] == _rounded(end) and info["recomputed_tokens"] == info["prompt_tokens"] - _rounded(end)
