"""`kiln --help` and each subcommand's help work, and bad usage exits 2 with a message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiln.cli import build_parser

SUBCOMMANDS = [
    ["corpus", "build"], ["corpus", "import"], ["corpus", "list"], ["corpus", "build-text"], ["snapshot", "create"],
    ["snapshot", "restore"], ["snapshot", "list"],
    ["snapshot", "show"], ["validate"], ["promote"], ["rollback"], ["stack"], ["demo"], ["train"], ["evaluate"],
    ["signals"], ["export"], ["verify"], ["datasheet"], ["reproduce"],
    ["keys", "trust"], ["keys", "list"],
]


def test_kiln_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for name in {s[0] for s in SUBCOMMANDS}:
        assert name in out


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_subcommand_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--help"])
    assert exc.value.code == 0
    assert "usage: kiln " + argv[0] in capsys.readouterr().out


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_corpus_build_help_lists_poison_kinds():
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "corpus", "build", "--help"],
                         capture_output=True, text=True, check=True).stdout
    from kiln.data.corpus import POISON_KINDS

    for kind in POISON_KINDS:
        assert kind in out
