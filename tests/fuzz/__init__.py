"""Fuzzing of the container parser, ``KVCodec.decode`` and every entropy coder (see ``cachegen_core.testing.fuzz``)."""
