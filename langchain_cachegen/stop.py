"""Stop sequences: cut a finished text, or filter a stream of pieces as it arrives.

The engine stops generating once a stop sequence appears but returns the text whole,
so the LangChain layer cuts it here, the same way for ``invoke`` and ``stream``.
"""

from __future__ import annotations

from collections.abc import Sequence


def cut_at_stop(text: str, stop: Sequence[str] | None) -> tuple[str, bool]:
    """``text`` up to the first occurrence of any stop sequence, and whether one occurred."""
    cut = min((i for s in stop or () if s and (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class StopStreamer:
    """Incremental stop-sequence filter: never emits text that a stop sequence could still claim."""

    def __init__(self, stop: Sequence[str] | None) -> None:
        self.stop = [s for s in stop or () if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.buffer = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Text safe to emit after ``piece`` arrived ('' once stopped)."""
        if self.stopped:
            return ""
        self.buffer += piece
        text, hit = cut_at_stop(self.buffer, self.stop)
        if hit:
            self.stopped = True
            self.buffer = ""
            return text
        safe = max(len(self.buffer) - self.hold if self.stop else len(self.buffer), 0)
        out, self.buffer = self.buffer[:safe], self.buffer[safe:]
        return out

    def finish(self) -> str:
        """The held-back tail once the stream ended ('' if a stop sequence was hit)."""
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out


__all__ = ["StopStreamer", "cut_at_stop"]
