"""`pdkv serve` on a port already in use fails before loading the model, with a message."""

from __future__ import annotations

import socket

import pytest

from pdkv.cli import main
from pdkv.engine.llm_engine import LLMEngine


def test_busy_port_fails_before_the_model_loads(monkeypatch, capsys):
    def load(*args, **kwargs):
        raise AssertionError("the model started loading")

    monkeypatch.setattr(LLMEngine, "from_engine_args", load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "smollm2", "--port", str(port), "--max-model-len", "256"]) != 0
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "choose another --port" in err
    with pytest.raises(
        AssertionError, match="started loading"
    ):  # a free port gets as far as loading
        main(["serve", "smollm2", "--port", "0", "--max-model-len", "256"])
