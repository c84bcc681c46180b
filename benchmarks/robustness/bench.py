"""What every robustness scenario uses: the tiny model and its plain answers, prompts, a warning counter, a tally."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from cachegen_core.engine import KVEngine
from cachegen_core.testing import make_tiny_llama, make_tiny_tokenizer, words

CHUNK = 64
NEW_TOKENS = 6
HANG_S = 60.0


# ------------------------------------------------------------------- model and prompts
@dataclass
class Bench:
    """The tiny model, its tokenizer and the plain greedy answers (computed once per prompt)."""

    model: Any
    tokenizer: Any
    _plain: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def tiny(cls, seed: int = 0) -> Bench:
        return cls(make_tiny_llama(seed), make_tiny_tokenizer())

    def plain(self, prompt: str) -> str:
        """The model's own greedy continuation, with no cache involved."""
        with self._lock:
            if prompt not in self._plain:
                ids = torch.tensor([self.tokenizer(prompt)["input_ids"]])
                with torch.no_grad():
                    out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                              do_sample=False, pad_token_id=self.tokenizer.eos_token_id)  # fmt: skip
                self._plain[prompt] = self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            return self._plain[prompt]

    def engine(self, store: Any, **kw: Any) -> KVEngine:
        kw.setdefault("background", False)
        kw.setdefault("store_options", [0])  # the scenarios spoil level-0 blobs (raw blobs: tests/test_raw.py)
        kw.setdefault("allow_text", False)  # ...and count the chunks fetched: never swapped for a recomputation
        return KVEngine(self.model, self.tokenizer, store=store, chunk_tokens=CHUNK, level=0, **kw)


def prompt(seed: int, chunks: int = 3, tail: int = 9) -> str:
    """A prompt of ``chunks`` complete chunks and a ``tail`` of words (tiny vocabulary).

    The seeds used below give prompts whose greedy answer is the same with the level-0 KV
    of any number of leading chunks (most seeds do; about one in seven flips a token on
    the random tiny model), so a wrong answer means a robustness failure, not codec noise."""
    return words(seed, chunks * CHUNK + tail)


# ---------------------------------------------------------------------- observation
class WarningCounter(logging.Handler):
    """Counts WARNING+ records of ``cachegen_core`` while installed (see ``counting_warnings``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def counting_warnings() -> Iterator[WarningCounter]:
    counter = WarningCounter()
    logger = logging.getLogger("cachegen_core")
    old_level = logger.level
    logger.setLevel(min(logger.getEffectiveLevel(), logging.WARNING))
    logger.addHandler(counter)
    try:
        yield counter
    finally:
        logger.removeHandler(counter)
        logger.setLevel(old_level)


@dataclass
class Tally:
    """Outcome of a scenario's requests."""

    scenario: str
    requests: int = 0
    answered: int = 0
    crashes: int = 0
    hangs: int = 0
    wrong_kv_accepted: int = 0
    max_request_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def ask(self, bench: Bench, engine: KVEngine, text: str, *, bad_chunks: int | None = None, exact: bool = True) -> Any:
        """Send one request; ``bad_chunks``: index of the first chunk whose stored blob must not be used.

        ``exact``: the request counts as answered only with the plain model's greedy text
        (else any answer counts, and exact matches are tallied in ``extra["plain_text"]``)."""
        self.requests += 1
        t = time.perf_counter()
        try:
            out, info = engine.generate(text, max_new_tokens=NEW_TOKENS)
        except Exception as e:  # noqa: BLE001  a crash: the request got no answer
            self.crashes += 1
            self.errors.append(f"{type(e).__name__}: {e}"[:300])
            return None
        finally:
            dt = time.perf_counter() - t
            self.max_request_s = max(self.max_request_s, dt)
            if dt > HANG_S:
                self.hangs += 1
        same = out == bench.plain(text)
        self.extra["plain_text"] = self.extra.get("plain_text", 0) + same
        if same or not exact:
            self.answered += 1
        if not same and exact:
            self.errors.append(f"wrong text for a prompt of {len(text.split())} words: {out!r} != {bench.plain(text)!r}")
        if bad_chunks is not None and info.cached_tokens > bad_chunks * CHUNK:
            self.wrong_kv_accepted += 1
        return info

    def row(self, warnings: WarningCounter | None = None, inputs: int | None = None) -> dict[str, Any]:
        r: dict[str, Any] = {
            "scenario": self.scenario,
            "inputs": self.requests if inputs is None else inputs,
            "crashes": self.crashes,
            "hangs": self.hangs,
            "wrong_kv_accepted": self.wrong_kv_accepted,
            "answered": self.answered,
            "requests": self.requests,
            "max_request_s": round(self.max_request_s, 3),
        }
        if warnings is not None:
            r["warnings"] = len(warnings.messages)
            r["warning_messages"] = [m[:160] for m in warnings.messages[:6]]
        r.update(self.extra)
        if self.errors:
            r["errors"] = self.errors[:5]
        return r
