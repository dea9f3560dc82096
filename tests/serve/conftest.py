"""One pdkv server (SmolLM2) shared by the server tests of a session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from server_utils import RemoteServer  # noqa: E402

NUM_KV_BLOCKS = 1024
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def server():
    args = ["serve", "--model", "smollm2", "--num-kv-blocks", str(NUM_KV_BLOCKS),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "128",
            "--served-model-name", "smollm2", "pdkv-alias"]
    with RemoteServer(args) as srv:
        yield srv


@pytest.fixture(scope="session")
def reference_llm(smollm2_reference):
    """The session's colocated SmolLM2 engine (tests/conftest.py; max_model_len 1024 too)."""
    return smollm2_reference
