"""The scheduler: the one owner of an engine's model, batching every running request's next token into one forward.

Continuous batching (Orca, vLLM): requests join and leave between steps. Each step is one packed forward
(``model/packed.py``) holding every decoding request's next token and, within a budget of tokens, pieces of the
prompts still being computed (a joining request's uncached tail, a text chunk a stream recomputes, a document), a
short tail (a question) first, then first come first served. While requests decode, the pieces of a step together
take about one decode step (from the prefill's cost the engine measured, at each piece's place in its prompt: later
tokens attend to more, corrected by what pieces beside decoding requests took in recent steps), so requests joining
hold the others' next token up by about one step, however many join; with nothing decoding a step takes up to
:data:`MAX_PIECE` prompt tokens and about :data:`MAX_STEP_S` (a request arriving behind a long prompt does not wait
for all of it). Each request picks its next token by its own :class:`~..model.decoding.Decoding` (greedy ones in one
op); a request that ends (a stop, its length, its cancel event, an error) leaves at once, the others go on. A step
that raises is run again request by request, so a failing request fails alone.

The step holds :attr:`Scheduler.lock`; other model work takes it between steps: :meth:`Scheduler.exclusive` for the
engine's own calls that are not steps (the blend, a request ``generate`` must serve), and background work through
``yielding.py`` (the profile fit, probes), which the process's :class:`~.turns.Turns` lends a share of the time
under continuous load. The thread starts when work arrives and ends when none is left.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..model import hf, own_decode, packed
from .request import Job, State
from .turns import TURNS, Turns

log = logging.getLogger("cachegen_core.engine")

#: Most prompt tokens one step computes (a prompt longer is computed in pieces of this many).
MAX_PIECE = 4096
#: Fewest prompt tokens a step gives a piece while requests decode.
MIN_PIECE = 16
#: Most seconds the pieces of a step take while nothing decodes (at the prefill's cost): a request arriving behind a
#: long prompt waits about this long at most, not for the whole prompt (on 2 cores, ~0.5-1 s pieces of a few hundred
#: tokens cost about what one long step does a token).
MAX_STEP_S = 1.0
#: Tokens the prefill's cost per token is read at (its fit, at the piece's position).
PROBE = 64
#: Most requests decoding together (a request past it waits for one to leave).
MAX_BATCH = 256
#: Weight of the newest step in the pieces' correction (their measured over their predicted seconds).
LEARN = 0.3
_SCHEDULERS: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _join_at_exit() -> None:
    """A scheduler still stepping while the interpreter finalises aborts the process (a torch op in a daemon thread):
    let each finish the step in hand; requests still waiting are not served."""
    for s in list(_SCHEDULERS):
        s._closing = True
        thread = s._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)


class Scheduler:
    """Runs :class:`~.request.Job` s on ``model`` (see the module doc). ``prefill_seconds(tokens, position)``: the
    measured prefill cost (sizes the pieces); ``observe_prefill(tokens, position, seconds)``: fed every step that
    computed one piece alone."""

    def __init__(self, model: Any, tokenizer: Any, *, turns: Turns = TURNS, prefill_seconds: Callable[[int, int], float] | None = None,
                 observe_prefill: Callable[[int, int, float], None] | None = None, max_batch: int = MAX_BATCH) -> None:  # fmt: skip
        self.model, self.tokenizer, self.turns = model, tokenizer, turns
        self.windows = hf.cache_layers(model)
        self.why_not = packed.packs(model)  # None: requests are batched
        own_decode.enabled()  # a CACHEGEN_DECODE_KERNEL that is not on or off stops the engine's construction, not a step
        self.prefill_seconds, self.observe_prefill, self.max_batch = prefill_seconds, observe_prefill, max_batch
        self.lock = threading.Lock()  # held for each step: model work outside steps takes it too
        self._cond = threading.Condition()
        self._new: deque[Job] = deque()
        self._running: list[Job] = []
        self._wanted = 0  # callers of exclusive() waiting for the model
        self._thread: threading.Thread | None = None
        self.steps = self.batched_steps = 0
        self.decode_s = 0.0  # last decode-only step's seconds
        self._decode_by: dict[int, float] = {}  # the last decode-only step's seconds, by how many requests decoded
        # what pieces beside decoding requests took over what the prefill's cost predicted (their own prompt alone):
        # deep in a long prompt, and beside a batch, a piece costs more than the fit says; an average of recent steps
        self.piece_scale = 1.0
        self.trace: deque[tuple[float, float, int, int]] = deque(maxlen=4096)  # (start, seconds, decoding, prompt tokens)
        self._closing = False  # the interpreter is exiting: step no more
        _SCHEDULERS.add(self)

    # ------------------------------------------------------------ submitting work
    def submit(self, job: Job) -> Job:
        """Queue ``job`` for the next step."""
        job.pending = len(job.ids)
        if not job.pending and job.decoding is None:  # nothing to compute
            job.state = State.FINISHED
            job.done.set()
            return job
        with self._cond:
            self._new.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="cachegen-scheduler", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return job

    def run(self, job: Job) -> Job:
        """Submit ``job`` and wait until it has left the batch (raises what failed it)."""
        return self.submit(job).wait()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The model for this thread alone, between two steps (for work that is not a step)."""
        with self._cond:
            self._wanted += 1
        try:
            with self.lock:
                yield
        finally:
            with self._cond:
                self._wanted -= 1
                self._cond.notify_all()

    @property
    def running(self) -> int:
        with self._cond:
            return len(self._running) + len(self._new)

    # ------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._wanted:
                    self._cond.wait(timeout=0.05)
                while self._new and len(self._running) < self.max_batch:
                    self._running.append(self._new.popleft())
                if not self._running or self._closing:
                    self._thread = None
                    return
                jobs = list(self._running)
            t = time.perf_counter()
            with self.lock, self.turns.busy():
                self._step(jobs)
            self.turns.lend(time.perf_counter() - t)

    @staticmethod
    def _prefilled(job: Job) -> None:
        """``job``'s prompt is computed: what it publishes (``on_prefilled``) becomes readable by others."""
        job.computed = True
        try:
            if job.on_prefilled is not None:
                job.on_prefilled()
        except Exception as e:  # noqa: BLE001  publishing is an optimisation: never a failure of the request
            log.warning("publishing a request's prefix failed: %s", e)
        job.prefilled.set()

    def _leave(self, job: Job, reason: str | None = None, error: BaseException | None = None) -> None:
        """``job`` leaves the batch: finished (``reason``), failed (``error``) or cancelled."""
        job.prefilled.set()  # nothing waits for a prompt that will not be computed
        if error is not None:
            job.error = error
        elif job.decoding is not None:
            self._finish(job, reason)
        job.state = State.FINISHED
        with self._cond:
            if job in self._running:
                self._running.remove(job)
        job.done.set()

    def _finish(self, job: Job, reason: str | None) -> None:
        """The answer's text and why it ended (as ``hf.generate`` says it: ``"stop"`` at an end of sequence, a stop
        string or a caller's criterion, ``"length"`` at the token limit, ``"cancelled"``); the streamer told."""
        from ..model.decoding import first_stop  # noqa: PLC0415

        d = job.decoding
        assert d is not None
        job.text = self.tokenizer.decode(job.new, skip_special_tokens=True) if job.new else ""
        job.stop_sequence = first_stop(job.text, d.stops)
        natural = (bool(job.new) and job.new[-1] in d.eos) or job.stop_sequence is not None
        if not natural and (len(job.new) >= d.max_new_tokens or reason == "length"):
            job.finish_reason = "length"
        elif not natural and reason == "cancelled":
            job.finish_reason = "cancelled"
        else:
            job.finish_reason = "stop"
        if job.streamer is not None:
            job.streamer.end()

    def _pieces(self, decoding: int, prefilling: list[Job]) -> list[tuple[Job, int]]:
        """The prompt tokens each prefilling job computes this step: those with at most :data:`PROBE` tokens left (a
        question after a cached context) first, then first come first served; up to :data:`MAX_PIECE` in all, and
        while requests decode about one decode step's worth in all (each token costed at its place in its prompt:
        later tokens attend to more), so that however many requests join, the decoding ones' next token waits about
        one step more; with none decoding, about :data:`MAX_STEP_S` at most, and no piece of a long prompt beside short
        tails (so their first token comes after their own prefill, not a long prompt's piece)."""
        tokens, pieces = MAX_PIECE, []
        seconds, scale = (self.step_s(decoding), self.piece_scale) if decoding else (MAX_STEP_S, 1.0)
        timed = self.prefill_seconds is not None
        short = False  # a short tail is computed this step
        for j in sorted(prefilling, key=lambda j: j.pending > PROBE):  # short tails (a question) before long prompts
            if tokens < MIN_PIECE or (timed and pieces and seconds <= 0):
                break
            if short and not decoding and j.pending > PROBE:  # their first token not held up by a long prompt's piece:
                break  # it goes on next step, beside them decoding
            short = short or j.pending <= PROBE
            n = min(j.pending, tokens)
            if timed:
                per = self._per_token(j)
                n = min(n, max(MIN_PIECE, int(seconds / (per * scale)) if seconds else PROBE))  # no decode step timed: PROBE
                if j.pending - n < MIN_PIECE:  # no piece under MIN_PIECE tokens left behind for a step of its own
                    n = min(j.pending, tokens)
                seconds -= n * per * scale
            pieces.append((j, n))
            tokens -= n
        return pieces

    def _per_token(self, job: Job) -> float:
        """The fitted prefill cost of a token of ``job``'s next piece (at its place in the prompt), seconds."""
        return max(self.prefill_seconds(PROBE, job.at + len(job.ids) - job.pending) / PROBE, 1e-7)  # type: ignore[misc]

    def step_s(self, decoding: int) -> float:
        """A decode step's seconds for ``decoding`` requests: the last such step, else the last of the most requests
        fewer, else the last decode step (0.0: none timed yet)."""
        timed = [n for n in self._decode_by if n <= decoding]
        return self._decode_by[max(timed)] if timed else self.decode_s

    def _step(self, jobs: list[Job]) -> None:
        for j in jobs:
            if j.cancelled:
                self._leave(j, "cancelled")
        jobs = [j for j in jobs if j.state is not State.FINISHED]
        decoding = [j for j in jobs if j.state is State.DECODING]
        pieces = self._pieces(len(decoding), [j for j in jobs if j.state is State.PREFILLING])
        if not decoding and not pieces:
            return
        predicted = sum(n * self._per_token(j) for j, n in pieces) if self.prefill_seconds is not None else 0.0
        t = time.perf_counter()
        try:
            self._forward(decoding, pieces)
        except Exception as e:  # noqa: BLE001  one request's failure must not fail the others: run them alone
            if len(decoding) + len(pieces) == 1:
                self._leave((decoding or [pieces[0][0]])[0], error=e)
                return
            log.warning("a batched step failed (%s): running its requests one by one", e)
            for j in decoding:
                self._alone([j], [])
            for j, n in pieces:
                self._alone([], [(j, n)])
            return
        seconds = time.perf_counter() - t
        self.trace.append((t, seconds, len(decoding), sum(n for _, n in pieces)))
        self.steps += 1
        self.batched_steps += len(decoding) + len(pieces) > 1
        decode = self.step_s(len(decoding)) if decoding else 0.0
        if decoding and not pieces:
            self.decode_s = self._decode_by[len(decoding)] = seconds
        elif decode and predicted > 0:  # what the pieces took: the step less a decode step
            ratio = min(max((seconds - decode) / predicted, 0.1), 10.0)
            self.piece_scale += LEARN * (ratio - self.piece_scale)
        elif len(pieces) == 1 and not decoding and self.observe_prefill is not None:
            j, n = pieces[0]
            self.observe_prefill(n, j.at + len(j.ids) - j.pending - n, seconds)

    def _alone(self, decoding: list[Job], pieces: list[tuple[Job, int]]) -> None:
        job = (decoding or [pieces[0][0]])[0]
        if job.state is State.FINISHED:
            return
        try:
            self._forward(decoding, pieces)
        except Exception as e:  # noqa: BLE001  reported to its caller
            self._leave(job, error=e)

    def _forward(self, decoding: list[Job], pieces: list[tuple[Job, int]]) -> None:
        """One packed forward of the decoding jobs' last tokens and the pieces, then each job's next token."""
        ids, positions, parts, keep, choosers = [], [], [], [], []
        row = 0
        for j in decoding:
            pos = j.at + len(j.ids) + len(j.new) - 1
            ids.append(j.new[-1])
            positions.append(pos)
            parts.append(_part(j, row, 1, pos))
            keep.append(row)
            choosers.append(j)
            row += 1
        for j, n in pieces:
            first = len(j.ids) - j.pending
            ids.extend(j.ids[first : first + n])
            positions.extend(range(j.at + first, j.at + first + n))
            parts.append(_part(j, row, n, j.at + first))
            row += n
            if n == j.pending and j.decoding is not None:
                keep.append(row - 1)
                choosers.append(j)
        device = self.model.device
        plan = packed.Plan(parts, self.windows)
        logits = packed.forward(self.model, torch.tensor(ids, device=device), torch.tensor(positions, device=device), plan,
                                torch.tensor(keep or [row - 1], device=device))  # fmt: skip
        for j, n in pieces:
            j.pending -= n
            if j.pending == 0:
                self._prefilled(j)
                if j.decoding is None:
                    self._leave(j)
        self._choose(choosers, logits)

    def _choose(self, jobs: list[Job], logits: torch.Tensor) -> None:
        """Each job's next token from its row of ``logits``; jobs that end leave."""
        greedy = [i for i, j in enumerate(jobs) if j.decoding is not None and j.decoding.plain_greedy]
        picked: dict[int, int] = {}
        if greedy:
            picked = dict(zip(greedy, logits[greedy].argmax(-1).tolist()))
        now = time.perf_counter()
        for i, j in enumerate(jobs):
            d = j.decoding
            assert d is not None
            try:
                if j.state is State.PREFILLING:
                    j.state = State.DECODING
                    j.history = _history(j, d.max_new_tokens)
                    if j.streamer is not None:
                        j.streamer.put(j.history[:, : len(j.prompt)].cpu())  # (1, n) as generate puts the prompt
                n = len(j.prompt) + len(j.new)
                tok = picked[i] if i in picked else d.choose(j.history[:, :n], logits[i])  # type: ignore[index]
                j.new.append(tok)
                j.history[0, n] = tok  # type: ignore[index]
                if j.ttft_s is None:
                    j.ttft_s = now - j.start
                if j.streamer is not None:
                    j.streamer.put(torch.tensor([tok]))
                room = j.kv.num_tokens - (j.at + len(j.ids) + len(j.new))
                if tok in d.eos or (d.criteria and d.stopped(j.history[:, : n + 1])):  # type: ignore[index]
                    self._leave(j, "stop")
                elif len(j.new) >= d.max_new_tokens or room < 0:
                    self._leave(j, "length")
                elif j.cancelled:
                    self._leave(j, "cancelled")
            except Exception as e:  # noqa: BLE001  a processor or criterion of this request failed: it alone
                self._leave(j, error=e)


def _part(job: Job, row: int, tokens: int, position: int) -> packed.Part:
    kv = job.kv
    return packed.Part(row, row + tokens, kv.own, position - kv.offset, kv.offset, kv.prefix)


def _history(job: Job, max_new: int) -> torch.Tensor:
    """(1, prompt + max_new) token ids, the prompt filled: what processors and stop checks read."""
    out = torch.zeros(1, len(job.prompt) + max_new + 1, dtype=torch.long)
    out[0, : len(job.prompt)] = torch.as_tensor(list(job.prompt), dtype=torch.long)
    return out
