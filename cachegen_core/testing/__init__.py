"""Helpers shared by the tests and the benchmarks, shipped so that neither imports the other.

- ``tiny``: tiny random-init Llama models, a word-level tokenizer and prompts for them;
- ``families``: a tiny random-init model of every decoder family the compatibility matrix checks;
- ``redis_server``: real ``redis-server`` processes on a free loopback port;
- ``redis_cluster``: a real Redis Cluster of them (``redis-cli --cluster create``), for failover tests;
- ``hub``: a stand-in Hugging Face hub on 127.0.0.1 (``StandInHub``), serving repositories a test writes;
- ``fuzz``: the structured fuzzer of the decoders, libFuzzer and atheris targets;
- ``tolerance``: how far floats computed along two different paths may differ.

Importing this package needs no test tool (no pytest) and loads no other module of
``cachegen_core``; redis-py (the ``redis`` extra) is needed only to start a server.

May import: anything of ``cachegen_core`` inside its functions (it sits above every layer); never ``tests/``.
"""

from __future__ import annotations

from .families import FAMILIES, make_family_model
from .hub import StandInHub
from .redis_server import RedisServer, find_redis_server, free_port, in_ci, running_redis_server, start_redis_server
from .tiny import make_tiny_kv, make_tiny_llama, make_tiny_tokenizer, words
from .tolerance import reorder_tolerance

__all__ = [
    "FAMILIES",
    "RedisServer",
    "StandInHub",
    "find_redis_server",
    "free_port",
    "in_ci",
    "make_family_model",
    "make_tiny_kv",
    "make_tiny_llama",
    "make_tiny_tokenizer",
    "reorder_tolerance",
    "running_redis_server",
    "start_redis_server",
    "words",
]
