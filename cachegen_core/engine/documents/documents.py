"""Document caches: each document's KV computed once on its own, stored under its content, reused anywhere.

A prompt's documents (the spans of a :class:`~cachegen_core.keys.segments.SegmentedPrompt`) that lie
after its reused prefix are looked up by content (``segments.document_pieces``: one store
request for every piece of every document of a batch), streamed into the prompt's buffer (a
piece shared by prompts of a batch once), their keys moved to where they landed
(``rope.shift_keys``), and the prompt between the prefix and the first cached document is
prefilled exactly. Then :func:`~.blend.blend` recomputes the selected share of the cached
tokens (those the question attends to most: :func:`~.blend.question_attention`) and every token
with no cached KV (text between documents, documents not stored), so that documents attend to
each other again. The question after the last document is left to generation. A document not in the store is computed on its own after the answer (``store``)
and queued for the writer, so the next prompt holding it, in any position, finds it.

Models :func:`~.blend.blend_support` refuses (another architecture, a rope type whose
frequencies depend on the sequence length) treat documents as plain text; the reason is logged once.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...keys.chunks import Chunk
from ...errors import BlobMissing, CacheGenFormatError, StoreError
from ...kv import KVCache
from ...keys.manifest import Manifest, manifest_key
from ...keys.segments import document_pieces
from ...ops.progress import progress_bar
from ...streaming import TEXT, Controller, Option, StreamFailure
from .indexer import DocumentIndexer
from .blend import BlendConfig, blend, blend_support, budget, forced_tokens, question_attention
from ..serving.info import GenerationInfo
from ..serving.request import Reused
from ..chunks.reader import report
from ..model.rope import Rope, shift_keys

if TYPE_CHECKING:
    from ...codec.kvcodec import KVCodec
    from ...streaming import Estimator
    from ..chunks.reader import ChunkReader
    from ..chunks.writer import ChunkWriter
    from ..serving.scheduler import Scheduler

log = logging.getLogger("cachegen_core.engine")


class Host(Protocol):
    """What the document step reads of the engine that owns it (a ``KVEngine``), at each use."""

    model: Any
    tokenizer: Any
    fingerprint: str
    codec: KVCodec
    chunk_tokens: int
    level: Option
    estimator: Estimator
    reader: ChunkReader
    writer: ChunkWriter
    scheduler: Scheduler  # the model's owner: every forward goes through it
    background: bool  # work after the answer in background threads (else before it returns)

    def _prefill(self, ids: list[int], buffer: KVCache, start: int) -> None: ...

    def compute_kv(self, ids: Sequence[int]) -> KVCache: ...


@dataclass(frozen=True)
class Indexed:
    """What ``store_documents`` did, by each document's index in the list it was given: ``stored`` (computed and
    written now, ``tokens`` in all), ``present`` (every piece already stored: nothing computed), ``skipped``
    (shorter than ``BlendConfig.min_document_tokens``, or any document of a model whose documents are never
    reused, ``blend_support``: prompts hold them as plain text); ``errors`` met
    looking the documents up (those were computed again)."""

    stored: tuple[int, ...] = ()
    present: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    tokens: int = 0
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Piece:
    """A stored piece of a document placed in a prompt (its span there, its key); ``shift``: how far its
    keys move from the positions they were computed at."""

    chunk: Chunk
    shift: int

    @property
    def place(self) -> tuple[str, int]:
        return self.chunk.key, self.chunk.start


class DocumentCaches:
    """The document step of an engine (see module doc)."""

    def __init__(self, engine: Host, config: BlendConfig) -> None:
        self.engine = weakref.proxy(engine)  # owned by the engine: no cycle keeping a dropped engine's buffers alive
        self.config = config
        support = blend_support(engine.model)
        self.rope: Rope | None = support if isinstance(support, Rope) else None
        self.unsupported = support if isinstance(support, str) else None
        bos = getattr(engine.tokenizer, "bos_token_id", None)
        self.preamble: tuple[int, ...] = (int(bos),) if bos is not None else ()
        self._warned = False
        self.indexer = DocumentIndexer(engine, self.preamble, self.pieces, background=engine.background)

    def pieces(self, doc_ids: Sequence[int]) -> list[Chunk]:
        """The stored pieces of a document (spans relative to it) with their keys."""
        e = self.engine
        return document_pieces(doc_ids, piece_tokens=e.chunk_tokens, fingerprint=e.fingerprint, codec_id=e.codec.codec_id,
                               profile_id=e.codec.profile_id or "", preamble=self.preamble)  # fmt: skip

    def compute(self, doc_ids: Sequence[int]) -> KVCache:
        """The document's KV computed on its own (after the preamble), at positions ``len(preamble)`` on."""
        return self.engine.compute_kv([*self.preamble, *doc_ids]).slice(len(self.preamble))

    def _refused(self) -> None:
        if not self._warned:
            log.warning("documents are prefilled as text: %s", self.unsupported)
            self._warned = True

    # ------------------------------------------------------------ before generation
    def reuse(
        self,
        prompts: Sequence[Sequence[int]],
        spans: Sequence[Sequence[tuple[int, int]]],
        buffers: Sequence[KVCache],
        covered: Sequence[int],
        infos: Sequence[GenerationInfo],
        controller: Controller,
    ) -> list[Reused]:
        """Fill each prompt's buffer past its ``covered`` prefix from the document caches (see module doc)."""
        plain = [Reused(done, len(ids)) for ids, done in zip(prompts, covered)]
        docs = [[(s, e) for s, e in sp if s >= done and e - s >= self.config.min_document_tokens] for sp, done in zip(spans, covered)]
        for d, info in zip(docs, infos):
            info.documents = len(d)
        if not any(docs):
            return plain
        if self.rope is None:
            self._refused()
            return plain
        placed = [[_Piece(Chunk(c.index, s + c.start, s + c.end, c.key), s - len(self.preamble))
                   for s, e in d for c in self.pieces(ids[s:e])] for ids, d in zip(prompts, docs)]  # fmt: skip
        held, text = self._stream(placed, buffers, infos, controller)
        return [self._blend(ids, d, pieces, h, text, buffer, done, info)
                for ids, d, pieces, h, buffer, done, info in zip(prompts, docs, placed, held, buffers, covered, infos)]  # fmt: skip

    def _blend(
        self, ids: Sequence[int], docs: list[tuple[int, int]], placed: list[_Piece], held: set[tuple[str, int]], text: set[str],
        buffer: KVCache, done: int, info: GenerationInfo,
    ) -> Reused:  # fmt: skip
        """One prompt's pieces moved into place, the text before them prefilled, then the selective recompute."""
        assert self.rope is not None
        mine = [x for x in placed if x.place in held]
        missing = tuple((s, e) for s, e in docs
                        if any(x.place not in held and x.chunk.key not in text for x in placed if s <= x.chunk.start < e))  # fmt: skip
        if not mine:
            return Reused(done, len(ids), missing=missing)
        for x in mine:
            shift_keys(buffer.slice(x.chunk.start, x.chunk.end).keys, x.shift, self.rope)
        start, end = mine[0].chunk.start, mine[-1].chunk.end
        if start > done:
            self.engine._prefill(list(ids[done:start]), buffer, done)
        cached = torch.zeros(end - start, dtype=torch.bool)
        for x in mine:
            cached[x.chunk.start - start : x.chunk.end - start] = True
        cfg, scores = self.config, None
        first = forced_tokens(cfg, docs, start, cached, question=end < len(ids))
        t = time.perf_counter()
        with self.engine.scheduler.exclusive():
            if cfg.select == "question" and end < len(ids) and budget(cached, cfg.recompute_ratio):
                scores = question_attention(self.engine.model, ids, buffer, start, end, cached, cfg.question_tokens)
            n = blend(self.engine.model, ids, buffer, start, end, cached, cfg.recompute_ratio,
                      check_layer=cfg.check_layer, query_block=cfg.query_block, first=first, scores=scores)  # fmt: skip
        info.blend_s = time.perf_counter() - t
        info.documents_reused = sum(any(s <= x.chunk.start < e for x in mine) for s, e in docs)
        info.blend_recomputed = n
        return Reused(end, start, computed=(start - done) + n, missing=missing)

    def _stream(
        self, placed: list[list[_Piece]], buffers: Sequence[KVCache], infos: Sequence[GenerationInfo], controller: Controller
    ) -> tuple[list[set[tuple[str, int]]], set[str]]:
        """Stream every stored piece into its prompts' buffers (at the positions it was computed at);
        returns per prompt the places (key, start) it holds, and the keys the controller sent as text."""
        reader = self.engine.reader
        keys = list(dict.fromkeys(x.chunk.key for pieces in placed for x in pieces))
        manifests = self._lookup(keys, infos[0], self.engine.level, controller.options)
        owner: dict[str, tuple[Chunk, int]] = {}
        for p, pieces in enumerate(placed):
            for x in pieces:
                if x.chunk.key in manifests:
                    owner.setdefault(x.chunk.key, (x.chunk, p))
        held: list[set[tuple[str, int]]] = [set() for _ in placed]
        text: set[str] = set()
        if not owner:
            return held, text

        def decode(blob: bytes, key: str, option: Option) -> KVCache:
            c, p = owner[key]
            kv = reader.decode(blob, key, option, out=buffers[p].slice(c.start, c.end))
            held[p].add((key, c.start))
            return kv

        def on_text(key: str) -> None:  # its tokens are computed in the prompt, with the blend's forced tokens
            text.add(key)

        requests = [list(dict.fromkeys(x.chunk.key for x in pieces if x.chunk.key in owner)) for pieces in placed]
        records, failure = reader.run_stream(requests, manifests, lambda k: owner[k][0], decode=decode,
                                             on_text=on_text, controller=controller, estimator=self.engine.estimator)  # fmt: skip
        if failure is not None:
            self._failed(infos[0], failure)
        decoded = {owner[k][0].key: owner[k] for p in held for k, _ in p}
        for p, (pieces, info) in enumerate(zip(placed, infos)):
            for x in pieces:  # a piece streamed once, into another place: copied over
                if x.chunk.key in decoded and x.place not in held[p]:
                    c, q = decoded[x.chunk.key]
                    src, dst = buffers[q].slice(c.start, c.end), buffers[p].slice(x.chunk.start, x.chunk.end)
                    dst.keys.copy_(src.keys)
                    dst.values.copy_(src.values)
                    held[p].add(x.place)
            asked = set(requests[p])
            for r in records:
                if r.chunk in asked and (r.chunk in decoded or r.option == TEXT):
                    info.stream.append(r.as_dict())
                    info.bytes_fetched += r.bytes
                    info.fetch_s += r.fetch_s
                    info.decode_s += r.decode_s
                    info.levels.append(r.option)
            reader.note_decode(info, [r.option for r in records if r.chunk in asked])
        return held, text

    def _lookup(self, keys: list[str], info: GenerationInfo, floor: Option, options: Sequence[Option]) -> dict[str, Manifest]:
        """Manifests of the stored pieces among ``keys`` (one store request), with an option at least as fine as ``floor``."""
        reader = self.engine.reader
        try:
            raw = reader.get_many([manifest_key(k) for k in keys])
        except StoreError as e:
            reader.trouble(info, f"store failure, documents recomputed: {e}")
            return {}
        found = {}
        for key, data in zip(keys, raw):
            manifest = reader.usable_manifest(data, floor, options, info, f"document piece {key[:12]}, recomputed")
            if manifest is not None:
                found[key] = manifest
        return found

    def _failed(self, info: GenerationInfo, f: StreamFailure) -> None:
        if isinstance(f.cause, BlobMissing):  # evicted since its manifest was read: a plain miss
            return
        if isinstance(f.cause, StoreError):
            self.engine.reader.trouble(info, f"store failure for a document piece, recomputed from there: {f.cause}")
        else:
            kind = "bad blob" if isinstance(f.cause, CacheGenFormatError) else "failure"
            report(info, f"{kind} for document piece {str(f.chunk)[:12]}, recomputed from there: {f.cause}")

    # ------------------------------------------------------------ after generation
    def store(self, ids: Sequence[int], reused: Reused, info: GenerationInfo, seen: set[str]) -> list[tuple[int, int]]:
        """Queue each missing document of the prompt for the background indexer (``indexer.py``: computed on its own
        after the answer, its pieces then queued for the writer; ``seen``: first piece keys already queued in this
        batch, added to); returns the spans queued."""
        queued, docs = [], []
        for s, e in reused.missing:
            pieces = self.pieces(ids[s:e])
            if pieces[0].key in seen:
                continue
            seen.add(pieces[0].key)
            docs.append(list(ids[s:e]))
            info.chunks_queued += len(pieces)
            queued += [(s + c.start, s + c.end) for c in pieces]
        if docs:
            self.indexer.submit(docs)
        return queued

    # ------------------------------------------------------------ ahead of any prompt
    def store_documents(self, documents: Sequence[str | Sequence[int]], progress: bool | None = None) -> Indexed:
        """Compute and write (now) each document (text, tokenised as a prompt's document is, or token ids) whose pieces
        are not all stored yet, with a progress bar (``progress``: see ``ops.progress``); says which were written."""
        if self.rope is None:  # a model blend_support refuses: its documents are never read back
            self._refused()
            return Indexed(skipped=tuple(range(len(documents))))
        tok, info = self.engine.tokenizer, GenerationInfo()
        docs = [list(tok(d, add_special_tokens=False)["input_ids"]) if isinstance(d, str) else list(map(int, d)) for d in documents]
        use = [i for i, d in enumerate(docs) if len(d) >= self.config.min_document_tokens]
        pieces = {i: self.pieces(docs[i]) for i in use}
        have = set(self._lookup(list(dict.fromkeys(c.key for i in use for c in pieces[i])), info, self.engine.level, None))
        present = [i for i in use if all(c.key in have for c in pieces[i])]
        stored, tokens = [], 0
        for i in progress_bar([i for i in use if i not in present], progress, desc="caching documents", unit="document"):
            if all(c.key in have for c in pieces[i]):  # the same document, written above
                present.append(i)
                continue
            kv = self.compute(docs[i])
            for c in pieces[i]:
                if c.key not in have:
                    self.engine.writer.write(c, kv.slice(c.start, c.end))
                    have.add(c.key)
            stored.append(i)
            tokens += len(docs[i])
        skipped = tuple(sorted(set(range(len(docs))) - set(use)))
        return Indexed(tuple(stored), tuple(sorted(present)), skipped, tokens, tuple(info.errors))
