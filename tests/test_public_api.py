"""The public API is importable from the package root, and importing the root stays cheap."""

import subprocess
import sys

import cachegen_core


def test_every_exported_name_resolves():
    for name in cachegen_core.__all__:
        assert getattr(cachegen_core, name) is not None, name
    assert cachegen_core.KVEngine.__module__ == "cachegen_core.engine.engine"


def test_unknown_names_are_attribute_errors():
    try:
        cachegen_core.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("no AttributeError")


def test_importing_the_package_does_not_import_torch():
    code = "import sys, cachegen_core; print('torch' in sys.modules, 'langchain_core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["False", "False"]


#: The names users import, by the module they import them from: moving code between modules keeps every one working.
PUBLIC = {
    "cachegen_core": [
        "BackendUnavailable",
        "BlobMissing",
        "CacheGenError",
        "CacheGenFormatError",
        "Chunk",
        "ChunkReader",
        "ChunkWriter",
        "CodecConfig",
        "CostModel",
        "DiskCacheStore",
        "GenerationInfo",
        "KVCache",
        "KVCodec",
        "KVEngine",
        "KVStore",
        "Manifest",
        "MemoryStore",
        "Profile",
        "RedisStore",
        "StoreError",
        "StoreURLError",
        "blob_key",
        "cache_dir",
        "chunk_keys",
        "load_model",
    ],
    "cachegen_core.stores": [
        "DEFAULT_NAMESPACE",
        "BaseKVStore",
        "DiskCacheStore",
        "KVStore",
        "MemoryStore",
        "RedisStore",
        "SignedStore",
        "default_directory",
        "open_store",
    ],
    "cachegen_core.engine": ["ChunkReader", "ChunkWriter", "CostModel", "GenerationInfo", "KVEngine", "StoreHealth"],
    "langchain_cachegen": ["ByteStoreKVStore", "CacheGenLLM", "ChatCacheGen", "KVByteStore", "format_documents"],
}


def test_the_public_names_import_from_where_users_import_them():
    import importlib

    for module, names in PUBLIC.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if getattr(mod, n, None) is None]
        assert missing == [], f"{module} lost {missing}"
        assert set(names) <= set(mod.__all__), f"{module}.__all__ lost {sorted(set(names) - set(mod.__all__))}"
