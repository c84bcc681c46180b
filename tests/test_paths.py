"""One cache directory for everything: ``CACHEGEN_CACHE_DIR`` moves every user of it."""

from cachegen_core.models import models_dir
from cachegen_core.paths import cache_dir
from cachegen_core.codec.profiles import profile_dir
from cachegen_core.stores.disk import DiskCacheStore, default_directory


def test_cachegen_cache_dir_moves_every_user_of_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    assert default_directory() == tmp_path / "c" / "kv"
    assert profile_dir() == tmp_path / "c" / "profiles"
    assert models_dir() == tmp_path / "c" / "models"
    with DiskCacheStore() as s:
        s.put("k", b"v")
    assert (tmp_path / "c" / "kv").is_dir()


def test_without_the_variable_the_user_cache_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv("CACHEGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("kv") == default_directory()
    assert cache_dir().name == "langchain-cachegen"
