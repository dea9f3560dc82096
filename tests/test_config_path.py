"""The engine's configuration stays at the top (issue 25): followed from `LLMEngine.__init__`
through the calls that pass it on (scripts/config_flow.py, `ast` over pdkv/, nothing run), it
enters few files and never comes back to one it left. Before the connectors took a spec of their
own (3820e33) the same reading entered 16 files; a change that hands the configuration (or one of
its parts) down past the component that owns it fails here."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import config_flow  # noqa: E402

MAX_FILES = 8  # half of the 16 entered at 3820e33


def test_the_config_path_is_short_and_one_way():
    path, entered = config_flow.measure(ROOT)
    assert path[0] == "pdkv/engine/llm_engine.py"
    assert config_flow.returns_of(path) == 0, path
    assert len(set(path)) <= MAX_FILES, path
    # The connectors see their spec, never the configuration.
    assert not [f for f in path if "connector/" in f and not f.endswith("connector/spec.py")]
    assert ("pdkv.kv_transfer.connector.spec", "connector_spec") in entered


def test_the_reading_follows_a_configuration_handed_down(tmp_path):
    """The measure itself: a component that passes `config.kv_transfer_config` on to the
    connector factory puts the factory on the path (so the test above can fail)."""
    src = ROOT / "pdkv"
    dst = tmp_path / "pdkv"
    for f in src.rglob("*.py"):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    engine = dst / "engine" / "llm_engine.py"
    text = engine.read_text(encoding="utf-8")
    handed = text.replace("spec, KVConnectorRole.SCHEDULER,",
                          "config.kv_transfer_config, KVConnectorRole.SCHEDULER,")
    assert handed != text
    engine.write_text(handed, encoding="utf-8")
    path, _ = config_flow.measure(tmp_path)
    assert "pdkv/kv_transfer/connector/factory.py" in path
