"""One request through the engine: a prompt, its KV, where it stands, what it generated and what it reports.

A :class:`Request` replaces the per-prompt parallel lists the engine kept (ids, chunks, buffer, covered, reused,
info): the engine builds one per prompt, the reader streams its stored chunks into its KV, the document step fills
what it can, and the scheduler prefills the rest and decodes it among the other running requests, moving it
through :class:`State` (as vLLM's ``Request`` and ``RequestStatus``). A :class:`Job` is what the scheduler drives:
tokens to compute into a KV, and, for a request that generates, its :class:`~..model.decoding.Decoding`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...keys.chunks import Chunk
from ..model.decoding import Decoding
from .info import GenerationInfo
from .prefixes import RequestKV


class State(enum.Enum):
    """Where a request stands: its KV being gathered (lookup, stream, documents), waiting for room in memory,
    its prompt being computed, generating, or done (answered, stopped, cancelled or failed)."""

    WAITING_KV = "waiting for its KV"
    WAITING_MEMORY = "waiting for memory"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(frozen=True)
class Reused:
    """What the prefix stream and the document step left in one prompt's KV.

    ``filled``: leading tokens the KV holds; ``exact``: the KV before this token is exact (what the prefix cache may
    store); ``computed``: tokens of ``[covered, filled)`` computed rather than reused; ``missing``: document spans to
    compute on their own and store after the answer.
    """

    filled: int
    exact: int
    computed: int = 0
    missing: tuple[tuple[int, int], ...] = ()


@dataclass(eq=False)
class Request:
    """A prompt answered by the engine (see the module doc). ``covered``: leading tokens found in the store (never
    stored again), ``reused``: what its KV holds before generation."""

    prompt: Any
    ids: list[int]
    chunks: list[Chunk]
    info: GenerationInfo
    kv: RequestKV
    start: float = field(default_factory=time.perf_counter)
    covered: int = 0
    reused: Reused | None = None
    state: State = State.WAITING_KV
    candidates: list[tuple[str, int]] = field(default_factory=list)  # prefixes of its prompt others may hold
    note: Any = None  # what it announced it fills (``SharedPrefixes.announce``)
    cancelled: bool = False  # cancelled before it got its KV

    @property
    def filled(self) -> int:
        return self.reused.filled if self.reused is not None else 0


@dataclass(eq=False)
class Job:
    """Model work the scheduler drives: compute ``ids`` into ``kv`` from position ``at`` on (a prompt's rest, a text
    chunk, a document), then, with a ``decoding``, generate until it ends.

    Set by the scheduler: ``new`` (the generated ids), ``text``, ``finish_reason`` (``"stop"``, ``"length"``,
    ``"cancelled"``), ``stop_sequence``, ``ttft_s`` (from ``start``, the request's arrival: queueing included),
    ``computed`` (whether the prompt was computed: False when cancelled before), ``error`` (what failed it), and
    ``done`` once it has left the batch."""

    ids: Sequence[int]
    kv: RequestKV
    at: int
    decoding: Decoding | None = None
    start: float = field(default_factory=time.perf_counter)
    streamer: Any = None
    cancel: threading.Event | None = None
    prompt: Sequence[int] = ()
    state: State = State.PREFILLING
    new: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_sequence: str | None = None
    ttft_s: float | None = None
    computed: bool = False
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    prefilled: threading.Event = field(default_factory=threading.Event)  # its prompt is computed (or it left)
    on_prefilled: Any = None  # called (by the scheduler) once its prompt is computed
    pending: int = 0  # tokens of ``ids`` not computed yet (set when the scheduler takes it)
    history: torch.Tensor | None = None  # (1, prompt + new) for processors and stop checks (decoding only)

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def wait(self) -> Job:
        """Block until the job has left the batch; raises what failed it."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self
