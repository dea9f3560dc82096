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
    p.add_argument(
        "--fused-ops", action=argparse.BooleanOptionalAction, default=True, help="C++ ops"
    )
    text = " ".join(p.format_help().split())
    assert "skip HF transformers --verbose" in text and "say more --batch-size" in text
    assert "requests per step (default: 8)" in text
    assert "C++ ops (default: True)" in text
    assert text.count("(default:") == 2


def test_a_help_that_states_its_default_gets_no_second_one():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument(
        "--cap",
        type=int,
        default=None,
        help="prompt tokens per step (0 = no cap; default 64 on CPU)",
    )
    p.add_argument("--replicate", action=argparse.BooleanOptionalAction, default=None,
                   help="hold whole shards; default: only when tp is 1")
    text = " ".join(p.format_help().split())
    assert (
        "(default: None)" not in text
        and "default 64 on CPU)" in text
        and "only when tp is 1" in text
    )


def test_serve_help_has_no_doubled_defaults():
    from pdkv.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    fmt = HelpFormatter("pdkv serve")
    helps = {
        a.option_strings[0]: fmt._get_help_string(a) or ""
        for a in serve._actions
        if a.option_strings
    }
    for flag in ("--dcp-replicate-weights", "--max-mixed-prefill-tokens"):
        assert helps[flag].lower().count("default") == 1, helps[flag]
    assert all(h.lower().count("(default:") <= 1 for h in helps.values())
