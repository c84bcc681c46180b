"""Streaming KV chunks under a deadline: bandwidth estimation, per-chunk choice of level or text, and
the pipelined drivers that run it. Plain functions over plain data: no model, no store.

- :mod:`.estimators`: bandwidth from measured fetches (harmonic mean, or the paper's last sample), a read's fixed
  cost apart from it where asked (the engine's, on a store on this host);
- :mod:`.controller`: the decision rule (:func:`choose`) and its pipeline prediction;
- :mod:`.driver`: :func:`stream_chunks` / :func:`stream_batch`, which fetch chunk i+1 while chunk i
  decodes, and the records they leave;
- :mod:`.fits`: costs fitted from measurements (non-negative, relative errors), the prefill's by position, a read's
  fixed cost.

May import: nothing of ``cachegen_core`` (plain Python over plain data).
"""

from .controller import (
    LOSSLESS,
    RAW,
    RAW_OPTIONS,
    TEXT,
    ChunkCost,
    Controller,
    Decision,
    Option,
    choose,
    compute_seconds,
    predict_finish,
    rank,
)
from .driver import (
    BatchResult,
    ChunkRecord,
    StreamFailure,
    StreamPlan,
    StreamResult,
    stream_batch,
    stream_chunks,
    unique_in_order,
)
from .estimators import ESTIMATORS, Estimator, HarmonicMeanEstimator, LastSampleEstimator, make_estimator

__all__ = [
    "ESTIMATORS",
    "LOSSLESS",
    "RAW",
    "RAW_OPTIONS",
    "TEXT",
    "BatchResult",
    "ChunkCost",
    "ChunkRecord",
    "Controller",
    "Decision",
    "Estimator",
    "HarmonicMeanEstimator",
    "LastSampleEstimator",
    "Option",
    "StreamFailure",
    "StreamPlan",
    "StreamResult",
    "choose",
    "compute_seconds",
    "make_estimator",
    "predict_finish",
    "rank",
    "stream_batch",
    "stream_chunks",
    "unique_in_order",
]
