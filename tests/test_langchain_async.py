"""Native async on CacheGenLLM and ChatCacheGen: concurrent requests, cancellation within one token.

The model's forward passes are observed with a forward pre-hook (which thread ran each one, how many tokens it
computed, in what order); one test holds a forward at a chosen token until the request is cancelled, so what
happens after the cancel is counted in forwards and their tokens, not timed.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from langchain_core.messages import HumanMessage

from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_llama, make_tiny_tokenizer, words
from langchain_cachegen import CacheGenLLM, ChatCacheGen

CHUNK = 32
LONG = 200  # new tokens a cancelled request would have generated


class Forwards:
    """Records which thread ran each forward pass of a model, in order; can hold one thread at its n-th forward."""

    def __init__(self, model) -> None:
        self.calls: list[threading.Thread] = []
        self.tokens: list[int] = []  # tokens each forward computed (every running request's, batched)
        self.hold_at: int | None = None  # hold the held thread's forward of this index (0-based, its own count)
        self.held_thread: threading.Thread | None = None
        self.reached, self.release = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        me = threading.current_thread()
        ids = kwargs.get("input_ids", args[0] if args else None)
        with self._lock:
            self.calls.append(me)
            self.tokens.append(int(ids.shape[-1]) if ids is not None else 0)
            mine = self.calls.count(me)
        if self.hold_at is not None and self.held_thread is None and mine > self.hold_at:
            self.held_thread = me
            self.reached.set()
            self.release.wait(60)

    def after(self, at: int, thread: threading.Thread) -> int:
        """How many forwards ``thread`` started after the ``at``-th forward."""
        return self.calls[at + 1 :].count(thread)


def _engine(model, **kw) -> KVEngine:
    kw = {"store": MemoryStore(), "chunk_tokens": CHUNK, "level": 0, "store_options": [0], "allow_text": False, "background": False, **kw}
    return KVEngine(model, make_tiny_tokenizer(), **kw)


def _llm(engine: KVEngine, max_new_tokens: int = 8) -> CacheGenLLM:
    return CacheGenLLM(engine=engine, model_id="tiny", generation_kwargs={"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens})


async def test_eight_concurrent_ainvokes_give_the_sequential_answers(tiny_llama):
    llm = _llm(_engine(tiny_llama), 4)
    chat = ChatCacheGen(llm=llm)
    prompts = [words(100 + i, 40 + 9 * i) for i in range(8)]
    histories = [[HumanMessage(p)] for p in prompts]
    llm.batch(prompts)
    chat.batch(histories)  # every complete chunk stored: each request below fetches and decodes, sequential or not
    sequential = [llm.invoke(p) for p in prompts], [chat.invoke(h).content for h in histories]
    concurrent = await asyncio.gather(*(llm.ainvoke(p) for p in prompts)), await asyncio.gather(*(chat.ainvoke(h) for h in histories))
    assert concurrent[0] == sequential[0]
    assert [m.content for m in concurrent[1]] == sequential[1]
    assert await llm.abatch(prompts) == sequential[0]
    streamed = await asyncio.gather(*(_collect(chat.astream(h)) for h in histories))
    assert streamed == sequential[1]


async def _collect(stream) -> str:
    return "".join([c.content async for c in stream])


@pytest.mark.parametrize("how", ["astream", "ainvoke"])
@pytest.mark.parametrize("face", ["llm", "chat"])
async def test_a_cancelled_request_stops_within_a_token_and_frees_the_model(how, face):
    model = make_tiny_llama()
    forwards = Forwards(model)
    try:
        engine = _engine(model)
        llm = _llm(engine, LONG)
        runnable = ChatCacheGen(llm=llm) if face == "chat" else llm
        prompt = [HumanMessage(words(120, 40))] if face == "chat" else words(120, 40)
        forwards.hold_at = 5  # the prefill, then 4 tokens; the 6th forward waits for the cancel
        if how == "astream":
            task = asyncio.ensure_future(_collect_any(runnable.astream(prompt)))
        else:
            task = asyncio.ensure_future(runnable.ainvoke(prompt))
        assert await asyncio.to_thread(forwards.reached.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # the request's cancel event is set by now
        at = len(forwards.calls) - 1  # the held forward: the token being computed when the request was cancelled
        forwards.release.set()
        forwards.hold_at = None
        short = _llm(engine, 3)
        runnable, nxt = (ChatCacheGen(llm=short), [HumanMessage(words(121, 30))]) if face == "chat" else (short, words(121, 30))
        answer = await runnable.ainvoke(nxt)
        # no token of the cancelled request after the one in flight: the next request alone, its prefill and 2 more tokens
        prompt_tokens = answer.usage_metadata["input_tokens"] if face == "chat" else len(engine.tokenize(nxt))
        assert forwards.tokens[at + 1 :] == [prompt_tokens, 1, 1]
        again = runnable.invoke(nxt)  # from the store, the same text
        if face == "chat":
            answer, again = answer.content, again.content
        assert answer == again  # the next request answered in full
    finally:
        forwards.release.set()
        forwards.handle.remove()


async def _collect_any(stream) -> list:
    return [c async for c in stream]


async def test_a_cancelled_request_is_recorded_as_cancelled_and_stores_its_prompt(tiny_llama):
    engine = _engine(tiny_llama)
    cancel = threading.Event()
    cancel.set()
    text, info = engine.generate(words(130, 70), cancel=cancel, max_new_tokens=LONG)
    assert (text, info.new_tokens, info.finish_reason, info.chunks_queued) == ("", 0, "cancelled", 0)  # nothing computed: nothing stored
    pieces = engine.stream(words(131, 70), max_new_tokens=LONG, min_new_tokens=LONG)
    assert next(pieces)
    pieces.close()  # a consumer gone: generation stops within a token
    _, after = engine.generate(words(131, 70), max_new_tokens=1)
    assert after.cached_tokens == 2 * CHUNK  # the closed stream's prompt was computed whole, and stored


class CountingStore(MemoryStore):
    """A memory store that counts the blobs read from it (keys ending ``-L<option>``)."""

    blob_reads = 0

    def get(self, key):
        self.blob_reads += "-L" in key[-4:]
        return super().get(key)

    def get_many(self, keys):
        self.blob_reads += sum("-L" in k[-4:] for k in keys)
        return super().get_many(keys)


async def test_a_requests_fetch_and_decode_proceed_while_another_holds_the_model():
    model = make_tiny_llama()
    forwards = Forwards(model)
    try:
        store = CountingStore()
        llm = _llm(_engine(model, store=store), 4)
        warm = words(150, 3 * CHUNK + 5)
        expected = llm.invoke(warm)  # its 3 chunks stored
        forwards.hold_at = 0  # a cold request's prefill holds the model
        cold = asyncio.ensure_future(llm.ainvoke(words(151, 20)))
        assert await asyncio.to_thread(forwards.reached.wait, 60)
        before = store.blob_reads
        hit = asyncio.ensure_future(llm.agenerate([warm]))
        for _ in range(6000):  # until the warm request has read its 3 chunks' blobs (decoded as they come)
            if store.blob_reads - before >= 3 or hit.done():
                break
            await asyncio.sleep(0.01)
        assert store.blob_reads - before == 3 and not cold.done() and not hit.done()  # the model is still held
        forwards.release.set()
        result = (await hit).generations[0][0]
        assert result.text == expected and result.generation_info["cached_tokens"] == 3 * CHUNK
        assert len((await cold).split()) == 4
    finally:
        forwards.release.set()
        forwards.handle.remove()
