"""Models by Hugging Face hub id (``org/name``), fetched into the Hugging Face cache as transformers fetches them.

``fetch("Qwen/Qwen2.5-0.5B-Instruct", options)`` downloads what transformers loads — the config, tokenizer and
chat template files, and the weights (``model.safetensors``, the shards its index names, else
``pytorch_model.bin``; ``*.py`` too with ``trust_remote_code``) — into the Hugging Face cache (``HF_HOME``,
``HF_HUB_CACHE``, or ``cache_dir``) with huggingface_hub's progress bars, and returns the snapshot directory.
Later calls find the files there: one request resolves the revision, none downloads. With ``gguf_file`` it fetches
that one file of a GGUF repository (``models`` converts it once, as any ``.gguf``). ``HF_HUB_OFFLINE=1`` (or
``local_files_only=True``) reads the cache only; ``HF_ENDPOINT`` names another hub (a mirror; the tests' stand-in on
127.0.0.1, ``testing/hub.py``). Every failure is a one-line ``ModelNotFoundError`` (``ModelNotCachedError``
offline, ``ModelDownloadError`` when the hub cannot be reached) saying what to do.

huggingface_hub (a dependency of transformers) is imported on first use.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelDownloadError, ModelNotCachedError, ModelNotFoundError

log = logging.getLogger(__name__)

#: ``model_kwargs`` that say where a hub model comes from, as ``from_pretrained`` takes them. They go to the
#: download, not to the loads (which read the downloaded files); ``trust_remote_code`` goes to both.
HUB_KEYS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "gguf_file")
#: What transformers reads beside the weights: config, generation config, tokenizer files, chat templates.
METADATA_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*", "vocab*", "merges*")
#: The weights transformers looks for, in its order, and the indexes of their shards.
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class HubOptions:
    """Where a hub model comes from: the ``from_pretrained`` keywords of ``HUB_KEYS``, and ``trust_remote_code``."""

    revision: str | None = None
    token: str | bool | None = None
    cache_dir: str | Path | None = None
    local_files_only: bool = False
    force_download: bool = False
    gguf_file: str | None = None
    trust_remote_code: bool = False

    @classmethod
    def split(cls, model_kwargs: Mapping[str, Any] | None) -> tuple[HubOptions, dict[str, Any]]:
        """``(options, the rest)``: ``model_kwargs`` split into the download's keywords and the loads'."""
        rest = dict(model_kwargs or {})
        found = {k: rest.pop(k) for k in HUB_KEYS if k in rest}
        return cls(**found, trust_remote_code=bool(rest.get("trust_remote_code", False))), rest

    @property
    def offline(self) -> bool:
        """Only the cache may be read: ``local_files_only``, or ``HF_HUB_OFFLINE`` (read by huggingface_hub at import)."""
        from huggingface_hub import constants  # noqa: PLC0415

        return bool(self.local_files_only or constants.HF_HUB_OFFLINE)

    def download_kwargs(self) -> dict[str, Any]:
        """The keywords of ``hf_hub_download`` and ``snapshot_download``."""
        return {"revision": self.revision, "token": self.token, "cache_dir": self.cache_dir,
                "local_files_only": self.offline, "force_download": self.force_download}  # fmt: skip


def is_hub_id(name: str | Path) -> bool:
    """True when ``name`` is spelled as a hub model id (``org/name`` or ``name``), not as a path or ``.gguf`` file."""
    if not isinstance(name, str) or name.count("/") > 1 or name.startswith((".", "/", "~")) or "\\" in name:
        return False
    if name.lower().endswith(".gguf"):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # noqa: PLC0415

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def storage_dir(repo_id: str, options: HubOptions) -> Path:
    """Where the Hugging Face cache keeps ``repo_id`` (``models--org--name``), whether or not it is there."""
    from huggingface_hub import constants  # noqa: PLC0415

    return Path(options.cache_dir or constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


def cached(repo_id: str, options: HubOptions) -> Path | None:
    """The cached snapshot directory of ``repo_id`` with its config and weights (with ``gguf_file``: that file), or
    None; never a request."""
    from huggingface_hub import snapshot_download, try_to_load_from_cache  # noqa: PLC0415
    from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415

    if options.gguf_file:
        found = try_to_load_from_cache(repo_id, options.gguf_file, cache_dir=options.cache_dir, revision=options.revision)
        return Path(found) if isinstance(found, str) else None
    try:
        snap = Path(snapshot_download(repo_id, revision=options.revision, cache_dir=options.cache_dir, local_files_only=True,
                                      allow_patterns=_metadata_patterns(options)))  # fmt: skip
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    weights = any((snap / name).is_file() for name in (*WEIGHTS, *INDEXES))
    return snap if (snap / "config.json").is_file() and weights else None


def fetch(repo_id: str, options: HubOptions) -> Path:
    """The local path of a hub model, downloaded into the Hugging Face cache where it is not there yet: its snapshot
    directory (config, tokenizer files, weights), or with ``gguf_file`` that file (a link in the snapshot)."""
    from huggingface_hub import snapshot_download  # noqa: PLC0415

    kw = options.download_kwargs()
    with _plain_errors(repo_id, options):
        if options.gguf_file:
            return _download(repo_id, [options.gguf_file], kw)
        snap = Path(snapshot_download(repo_id, allow_patterns=_metadata_patterns(options), **kw))
        if not (snap / "config.json").is_file():
            raise _not_cached(repo_id, options) if options.offline else _not_transformers(repo_id, options, snap.name, "config.json")
        _fetch_weights(repo_id, snap, options, {**kw, "revision": snap.name})  # the commit: cached files need no request
    return snap


def _metadata_patterns(options: HubOptions) -> list[str]:
    return [*METADATA_PATTERNS, *(["*.py"] if options.trust_remote_code else [])]


def _fetch_weights(repo_id: str, snap: Path, options: HubOptions, kw: dict[str, Any]) -> None:
    """Download the weights transformers would load from ``snap``: the shards an index names, else the first of
    ``WEIGHTS`` the repository has."""
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError  # noqa: PLC0415

    for index in INDEXES:
        if (snap / index).is_file():
            try:
                shards = sorted(set(json.loads((snap / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ModelNotFoundError(f"{repo_id!r}: its {index} is not an index of shards ({type(e).__name__}: {e})") from None
            _download(repo_id, shards, kw)
            return
    for name in WEIGHTS:
        try:
            _download(repo_id, [name], kw)
            return
        except LocalEntryNotFoundError:  # first: a subclass of EntryNotFoundError in huggingface_hub 0.x
            if not options.offline:
                raise  # the hub went away meanwhile
        except EntryNotFoundError:
            continue  # not in the repository: the next form
    raise _not_cached(repo_id, options) if options.offline else _not_transformers(repo_id, options, snap.name, " or ".join(WEIGHTS))


def _download(repo_id: str, names: list[str], kw: dict[str, Any]) -> Path:
    """``hf_hub_download`` of each of ``names`` (the last one's path returned), first logging those not in the cache
    and their size (huggingface_hub's byte bars show on a terminal only). A name the repository lacks raises
    ``EntryNotFoundError`` before anything is downloaded."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache  # noqa: PLC0415
    from huggingface_hub.errors import EntryNotFoundError  # noqa: PLC0415

    def in_cache(name: str) -> bool:
        return isinstance(try_to_load_from_cache(repo_id, name, cache_dir=kw["cache_dir"], revision=kw["revision"]), str)

    todo = [] if kw["local_files_only"] else [n for n in names if kw["force_download"] or not in_cache(n)]
    sizes: list[int | None] = []
    for name in todo:
        try:
            sizes.append(get_hf_file_metadata(hf_hub_url(repo_id, name, revision=kw["revision"]), token=kw["token"]).size)
        except EntryNotFoundError:
            raise
        except Exception:  # noqa: BLE001  (the download below meets the same trouble, and says it)
            sizes.append(None)
    if todo:
        size = "" if None in sizes else f" ({sum(s or 0 for s in sizes) / 1e6:,.1f} MB)"
        log.warning("downloading %s%s of %s from %s into the Hugging Face cache (%s)", ", ".join(todo), size, repo_id,
                    _hub(), storage_dir(repo_id, HubOptions(cache_dir=kw["cache_dir"])))  # fmt: skip
    return Path([hf_hub_download(repo_id, name, **kw) for name in names][-1])


def _hub() -> str:
    from huggingface_hub import constants  # noqa: PLC0415

    return f"the Hugging Face hub ({constants.ENDPOINT})"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _not_cached(repo_id: str, options: HubOptions) -> ModelNotCachedError:

    why = "local_files_only=True" if options.local_files_only else "HF_HUB_OFFLINE is set"
    what = f"{options.gguf_file!r} of {repo_id!r}" if options.gguf_file else repr(repo_id)
    rev = f" (revision {options.revision!r})" if options.revision else ""
    get = f"hf download {repo_id}" + (f" {options.gguf_file}" if options.gguf_file else "")
    return ModelNotCachedError(
        f"{what}{rev} is not in the local Hugging Face cache ({storage_dir(repo_id, options).parent}) and downloads are off "
        f"({why}): download it once where the hub is reachable (`{get}`, or a first load without {why.split()[0]})"
    )


def _not_transformers(repo_id: str, options: HubOptions, commit: str, missing: str) -> ModelNotFoundError:
    """``repo_id`` has no ``missing`` file: not a transformers checkpoint; the GGUF files it holds are named."""
    from huggingface_hub import HfApi  # noqa: PLC0415

    try:  # one more request, on this error's path only
        ggufs = [f for f in HfApi().list_repo_files(repo_id, revision=commit, token=options.token) if f.lower().endswith(".gguf")]
    except Exception:  # noqa: BLE001  (the hint is optional; the error stands without it)
        ggufs = []
    hint = ""
    if ggufs:
        listed = ", ".join(ggufs[:4]) + (", ..." if len(ggufs) > 4 else "")
        hint = f": it holds GGUF files ({listed}); load one with model_kwargs={{'gguf_file': {ggufs[0]!r}}}"
    return ModelNotFoundError(f"{repo_id!r} (revision {options.revision or 'main'!r}) on {_hub()} has no {missing}, so it is no "
                              f"transformers model{hint}")  # fmt: skip


@contextlib.contextmanager
def _plain_errors(repo_id: str, options: HubOptions) -> Iterator[None]:
    """huggingface_hub's errors (several lines, about URLs) as one-line ``ModelNotFoundError`` saying what to do."""
    from huggingface_hub.errors import (  # noqa: PLC0415
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token = "pass a token (model_kwargs={'token': ...}) or log in once (`hf auth login`)"
    try:
        yield
    except GatedRepoError:
        raise ModelNotFoundError(f"{repo_id!r} is gated on {_hub()}: accept its conditions on its page, then {token}") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id!r} is no local directory or .gguf file, and {_hub()} has no model of that name: check the name or "
            f"path; for a private model, {token}"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id!r} has no revision {options.revision!r} on {_hub()}: pass a branch, tag or commit it has as model_kwargs['revision']"
        ) from None
    except LocalEntryNotFoundError as e:  # before EntryNotFoundError: a subclass of it in huggingface_hub 0.x
        if options.offline:
            raise _not_cached(repo_id, options) from None
        cause = e.__cause__ if e.__cause__ is not None else e
        raise ModelDownloadError(
            f"could not download {repo_id!r} from {_hub()} ({_first_line(cause)}), and it is not in the local Hugging Face "
            "cache: check the network, a proxy or HF_ENDPOINT (or set HF_HUB_OFFLINE=1 where the cache has it)"
        ) from e
    except EntryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id!r} (revision {options.revision or 'main'!r}) on {_hub()} has no file {options.gguf_file!r}: name one of "
            "its files as model_kwargs['gguf_file']"
        ) from None
    except HfHubHTTPError as e:  # a server error, a refused token...
        raise ModelDownloadError(f"could not download {repo_id!r} from {_hub()}: {_first_line(e)}") from e
