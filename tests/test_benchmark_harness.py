"""The benchmarks' harness (``benchmarks/common.py``): rows on stdout and appended to ``--out`` after a meta row
saying what produced them."""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

import torch

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
