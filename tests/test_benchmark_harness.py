"""The benchmarks' harness (``benchmarks/common.py``): rows on stdout and appended to ``--out`` after a meta row
saying what produced them, and the same shared options in every benchmark's parser."""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import benchmarks
from benchmarks import common

META_KEYS = {"row", "benchmark", "command", "date", "machine", "cores", "gpu", "torch", "transformers", "commit"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_go_to_stdout_and_are_appended_after_a_meta_row_in_the_file_only(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    with common.Rows("codec_micro", out, ["--quick", "--data", "my file.jsonl"]) as rows:
        rows.emit({"level": 0, "bits": 3.5})
        rows.emit({"level": 1, "bits": 2.5})
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"level": 0, "bits": 3.5}, {"level": 1, "bits": 2.5}]
    meta, *data = _lines(out)
    assert data == [{"level": 0, "bits": 3.5}, {"level": 1, "bits": 2.5}]
    assert set(meta) == META_KEYS and meta["row"] == "meta" and meta["benchmark"] == "codec_micro"
    assert meta["command"] == "python -m benchmarks.codec_micro --quick --data 'my file.jsonl'"
    date = datetime.datetime.fromisoformat(meta["date"])
    assert date.utcoffset() == datetime.timedelta(0) and abs(datetime.datetime.now(datetime.timezone.utc) - date).total_seconds() < 60
    assert meta["machine"] and meta["cores"] == os.cpu_count()
    assert meta["torch"].split("+")[0] == torch.__version__.split("+")[0] and meta["transformers"]
    assert meta["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}", meta["commit"])

    with common.Rows("codec_micro", out, []) as rows:  # a second run appends: its own meta row, then its rows
        rows.emit({"level": 2})
    assert [r.get("row") for r in _lines(out)] == ["meta", None, None, "meta", None]
    assert _lines(out)[3]["command"] == "python -m benchmarks.codec_micro"
    assert common.results(out) == [{"level": 0, "bits": 3.5}, {"level": 1, "bits": 2.5}, {"level": 2}]


def test_without_out_rows_are_only_printed(tmp_path, capsys):
    with common.Rows("reuse") as rows:
        rows.emit({"a": 1})
    assert capsys.readouterr().out == '{"a": 1}\n' and list(tmp_path.iterdir()) == []
    assert rows.rows == [{"a": 1}]  # kept for a plot at the end


#: Modules of ``benchmarks/`` with a ``main`` that measure nothing: ``plots`` redraws the results page's pictures.
NOT_BENCHMARKS = {"benchmarks.plots"}


def benchmark_modules() -> dict[str, object]:
    """Every module of ``benchmarks/`` with a ``main``: the runnable benchmarks."""
    mods = {}
    for info in pkgutil.walk_packages(benchmarks.__path__, "benchmarks."):
        if info.name in NOT_BENCHMARKS:
            continue
        mod = importlib.import_module(info.name)
        if callable(getattr(mod, "main", None)) and mod.main.__module__ == info.name:
            mods[info.name] = mod
    return mods


BENCHMARKS = benchmark_modules()
#: Benchmarks of a model that has no codec profile (a shaped one by default: the reference model ships with one).
NEED_NO_PROFILE = {"benchmarks.first_request"}


def test_the_runnable_benchmarks_are_found():
    assert {"benchmarks.codec_micro", "benchmarks.warm_path", "benchmarks.robustness.__main__", "benchmarks.fuzz"} <= set(BENCHMARKS)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_parses_the_shared_options_the_same_way(name, tmp_path):
    ap = BENCHMARKS[name].arguments()
    base = ap.parse_args([])
    assert base.quick is False and base.out is None
    args = ap.parse_args(["--quick", "--out", str(tmp_path / "o.jsonl")])
    assert args.quick is True and args.out == tmp_path / "o.jsonl"
    if ap.get_default("data") is not None:  # the benchmarks that read transcripts
        assert base.data == common.LONGCHAT
        assert ap.parse_args(["--data", str(tmp_path / "d.jsonl")]).data == tmp_path / "d.jsonl"
    if ap.get_default("model") is not None:
        # the reference model by default, but for a benchmark of what a model without a profile does (it has one)
        assert base.model == common.DEFAULT_MODEL or (name in NEED_NO_PROFILE and common.is_shaped(base.model))
        assert ap.parse_args(["--model", "m"]).model == "m"
    if ap.get_default("device") is not None:
        assert base.device == "cpu" and ap.parse_args(["--device", "cuda"]).device == "cuda"
