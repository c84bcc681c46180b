"""Requests from asyncio: each one runs in a thread of its own, and a cancelled one stops generating.

The engine's work is synchronous (tokenising, fetching and decoding, the model's calls under the
engine's lock). :func:`run_in_thread` runs it in a thread started for the request, so the event
loop never waits on it, and requests overlap as threads do: one fetches and decodes while another
holds the model. Cancelling the awaiting task sets the request's ``cancel`` event; generation checks
it after every token (``hf.generate``), so the model is released within one token and the request
behind it starts. :func:`astream_pieces` does the same for streamed text.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _settle(fut: asyncio.Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    if fut.done():  # the awaiting task was cancelled: nobody reads it
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


async def run_in_thread(fn: Callable[[], T], cancel: threading.Event) -> T:
    """``fn()`` in a new thread, awaited without blocking the loop; cancelling the awaiting task sets ``cancel``
    (``fn`` is expected to stop soon after) and raises ``CancelledError`` at once."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001  handed to the awaiting task
            error: BaseException | None = e
            result = None
        else:
            error = None
        try:
            loop.call_soon_threadsafe(_settle, fut, result, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    threading.Thread(target=target, name="cachegen-request", daemon=True).start()
    try:
        return await fut
    except asyncio.CancelledError:
        cancel.set()
        raise


async def astream_pieces(tokenizer: Any, run: Callable[[Any], tuple[str, Any]], cancel: threading.Event) -> AsyncIterator[Any]:
    """The text pieces ``run(streamer)`` generates (in a thread of its own), then the second item of what it returns;
    an exception it raises is raised here. Leaving the iteration early (cancelled, closed) sets ``cancel``."""
    from transformers import AsyncTextIteratorStreamer  # noqa: PLC0415

    streamer = AsyncTextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    def target() -> tuple[str, Any]:
        try:
            return run(streamer)
        finally:
            try:
                streamer.end()  # a no-op after generate() ended it; wakes the reader after an error
            except RuntimeError:  # the loop is closed
                pass

    done = asyncio.ensure_future(run_in_thread(target, cancel))
    finished = False
    try:
        async for piece in streamer:
            if piece:
                yield piece
        _, info = await done
        finished = True
        yield info
    finally:
        if not finished:
            cancel.set()
            done.cancel()
