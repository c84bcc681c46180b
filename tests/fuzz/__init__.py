"""Fuzzing of the container parser, ``KVCodec.decode`` and every entropy coder (see ``harness``)."""
