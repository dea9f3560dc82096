"""The argparse parser class of every `pdkv` command: no abbreviated flags, and a "did you
mean" hint for a mistyped flag or subcommand (`difflib.get_close_matches` over the flags of the
subcommand being parsed)."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

_CHOICE_RE = re.compile(r"invalid choice: '([^']*)' \(choose from ([^)]*)\)")


class PdkvArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with `allow_abbrev=False` by default (so `--max-num` is an
    error, not `--max-num-seqs`) whose errors suggest the closest known flag or choice.
    Subparsers made with `add_subparsers().add_parser` get the same class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        import sys

        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        hint = suggestion(self, self._argv, message)
        text = message + (f"; {hint}" if hint else "")
        # argparse reports leftover arguments from the root parser; show the usage of the
        # subcommand they were given to (`pdkv up --mdoe`: "usage: pdkv up ...").
        chosen = _scope(self, self._argv)[-1] if "unrecognized arguments:" in message else self
        if chosen is not self:
            chosen.print_usage(sys.stderr)
            chosen.exit(2, f"{chosen.prog}: error: {text}\n")
        super().error(text)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _scope(parser: argparse.ArgumentParser, argv: list[str]) -> list[argparse.ArgumentParser]:
    """The chain of parsers `argv` selects: the root, then each subcommand named in it."""
    chain = [parser]
    rest = list(argv)
    while True:
        subs = _subparsers(chain[-1])
        idx = next((i for i, a in enumerate(rest) if a in subs), None)
        if idx is None:
            return chain
        chain.append(subs[rest[idx]])
        rest = rest[idx + 1:]


def suggestion(parser: argparse.ArgumentParser, argv: list[str], message: str) -> str:
    """A "did you mean ...?" hint for an argparse error `message` ("" when none is close).

    Unrecognized flags are matched against the flags of the subcommand `argv` selects (and its
    parents); an invalid choice against the choices named in the message.
    """
    m = _CHOICE_RE.search(message)
    if m:
        choices = [c.strip().strip("'") for c in m.group(2).split(",")]
        close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
        return f"did you mean {close[0]!r}?" if close else ""
    if "unrecognized arguments:" not in message and "ambiguous option" not in message:
        return ""
    known = [s for p in _scope(parser, argv) for a in p._actions for s in a.option_strings]
    close_flags = []
    for word in message.split(":", 1)[1].replace(",", " ").split():
        if not word.startswith("--"):
            continue
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        if close and close[0] != flag:
            close_flags.append((flag, close[0]))
    if len(close_flags) == 1:
        return f"did you mean {close_flags[0][1]}?"
    return " ".join(f"did you mean {good} (for {bad})?" for bad, good in close_flags)
