"""Argument checks the subcommands share, all made before any work starts: a bad value is a usage
error (exit 2) naming the flag, rather than a default in disguise, a fault deep inside the command,
or a traceback after an hour of work.

* argparse types for numeric flags (``positive_int``, ``non_negative_int``);
* ``refuse_unusable_target``: a path the command will write (a file where a directory is expected,
  a read-only mount, a parent that is a file).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.errors import ConfigError
from kiln.util.fs import unusable_target_reason


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of nodes, ranks, steps or windows)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a number of restarts)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def refuse_unusable_target(flag: str, path: Path, *, directory: bool) -> None:
    """``ConfigError`` (exit 2) naming the flag when ``path`` cannot be written (``unusable_target_reason``)."""
    reason = unusable_target_reason(path, directory=directory)
    if reason:
        raise ConfigError(f"{flag} {path}: {reason}")
