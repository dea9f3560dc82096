"""`pdkv ... --help` shows defaults for options that take a value, not for value-less flags: a
`--no-X` flag's stored default (True) would read as if the flag were on."""

from __future__ import annotations

import argparse

from pdkv.cli import HelpFormatter


def test_value_less_flags_show_no_default_and_options_keep_theirs():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--no-hf", dest="include_hf", action="store_false", help="skip HF transformers")
    p.add_argument("--verbose", action="store_true", help="say more")
    p.add_argument("--batch-size", type=int, default=8, help="requests per step")
    p.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=True, help="C++ ops")
    text = " ".join(p.format_help().split())
    assert "skip HF transformers --verbose" in text and "say more --batch-size" in text
    assert "requests per step (default: 8)" in text
    assert "C++ ops (default: True)" in text
    assert text.count("(default:") == 2
