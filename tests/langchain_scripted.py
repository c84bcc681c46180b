"""Helpers for the LangChain tests: an engine whose answers are scripted.

A tiny random model cannot write a tool call or JSON, so tests of how answers are read
replace the engine's generation with a fixed text (recording the prompts it was given);
everything above the engine (rendering, parsing, streaming, metadata) runs for real.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from cachegen_core.engine import GenerationInfo, KVEngine


def script_answers(
    engine: KVEngine, monkeypatch: pytest.MonkeyPatch, *answers: str, piece: int = 3, run_engine: bool = False
) -> list[dict[str, Any]]:
    """Make ``engine`` answer with ``answers`` in turn (the last one repeats); returns the calls it gets.

    Each call is recorded as ``{"prompt": ids, "gen": kwargs}``; streams yield ``piece``
    characters at a time. ``new_tokens`` counts words, ``max_new_tokens`` is honoured as a cap.
    ``run_engine``: the engine still answers each prompt (fetching, computing and storing
    its chunks), and its info is reported; only the text is replaced.
    """
    calls: list[dict[str, Any]] = []
    real = engine.generate_many

    def answer(prompt: Sequence[int], gen: dict[str, Any]) -> tuple[str, GenerationInfo]:
        calls.append({"prompt": list(prompt), "gen": dict(gen)})
        text = answers[min(len(calls) - 1, len(answers) - 1)]
        if run_engine:
            return text, real([prompt], **gen)[0][1]
        n = len(text.split())
        return text, GenerationInfo(prompt_tokens=len(prompt), new_tokens=min(n, gen.get("max_new_tokens", n)))

    def generate_many(prompts: Sequence[Sequence[int]], **gen: Any) -> list[tuple[str, GenerationInfo]]:
        return [answer(p, gen) for p in prompts]

    def stream(prompt: Sequence[int], **gen: Any) -> Iterator[str | GenerationInfo]:
        text, info = answer(prompt, gen)
        for i in range(0, len(text), piece):
            yield text[i : i + piece]
        yield info

    monkeypatch.setattr(engine, "generate_many", generate_many)
    monkeypatch.setattr(engine, "stream", stream)
    return calls
