"""What the user may have meant: the close spellings of an unknown flag among a parser's.

>>> import argparse
>>> p = argparse.ArgumentParser(prog="anydevice top")
>>> _ = p.add_argument("--json", action="store_true")
>>> _ = p.add_argument("--once", action="store_true")
>>> unknown_arguments(p, ["--jsno"])
'unrecognized arguments: --jsno (did you mean --json?)'
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

__all__ = ["close_flag", "unknown_arguments"]


def close_flag(word: str, parser: argparse.ArgumentParser) -> str | None:
    """The parser's flag closest to ``word`` (``--jsno`` -> ``--json``), or None."""
    if not word.startswith("-"):
        return None
    flags = [f for action in parser._actions for f in action.option_strings]
    name = word.split("=", 1)[0]
    found = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_arguments(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """argparse's "unrecognized arguments" message, each flag with its likely meaning."""
    words = []
    for word in extras:
        guess = close_flag(word, parser)
        words.append(f"{word} (did you mean {guess}?)" if guess else word)
    return "unrecognized arguments: " + " ".join(words)
