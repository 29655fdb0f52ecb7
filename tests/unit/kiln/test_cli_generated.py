"""Generated command lines (issue 16, "the class, not the instances"): every ``kiln`` entry point
that reads paths, numbers or names, fed argument lists that Hypothesis builds from the parser's own
flags and from hostile values, on real file systems (a full tmpfs, a read-only tmpfs, a FIFO, a
symlink loop, names over 255 bytes, a file where a folder is expected).

For every command line, whatever it is:

* nothing escapes ``kiln.cli.main`` but its exit status (argparse's own exit included): no traceback;
* the status is one of the documented ones (0, 1 fault, 2 usage, 3 a gate said no), and a failure
  prints exactly one ``kiln <command>: error:`` line;
* nothing is written that claims something false: a command that failed (1 or 2) leaves no new
  file outside ``KILN_HOME`` and changes no file that was there before.

The examples are derandomized (the same ones on every run, so CI never meets a new one by chance);
docs/reliability.md ("Generated bad input") records the larger random runs and what they found.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.cli import main

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("KILN_GENERATED_EXAMPLES", "60"))
RANDOM = os.environ.get("KILN_GENERATED_RANDOM") == "1"  # exploratory runs: new examples each time
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Relative to the sandbox (the working directory while a command runs): nothing generated can
# reach outside it, so a command that wrongly succeeds cannot overwrite a file of the machine.
PLACES = ["missing", "missing/child", "file.txt", "file.txt/child", "empty.json", "dir", "dir/new.json", "nonempty",
          "fifo", "loop", "loop/child", "full", "full/new.json", "ro", "ro/new.json", "corpus", "corpus/train",
          "corpus/new.json", "new.json", "new-dir", ".", "x" * 300, "x" * 255, " ", "-", "--", "-x",
          "new\nline.json", "ünï cödé.json", "corpus/train/shard-00000.parquet"]
path_names = st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=40)
paths = st.one_of(st.sampled_from(PLACES), path_names.filter(lambda p: p not in (".", "..")),
                  st.builds(lambda a, b: f"{a}/{b}", st.sampled_from(PLACES[:20]), path_names))
numbers = st.one_of(st.integers(min_value=-(2**70), max_value=2**70).map(str), st.integers(min_value=-3, max_value=70).map(str),
                    st.sampled_from(["", "0", "-0", "1e3", "nan", "inf", "-inf", "0x10", " 3", "3 ", "٣", "1_000", "0.5",
                                     "1.5", "65536", "10000000000"]))
names = st.one_of(st.sampled_from(["stdlib-py", "stdlib-py@1", "stdlib-py@2", "stdlib-py@", "@1", "web-text@1", "nope",
                                   "../stdlib-py", "sandbox", "production", "kiln-stdlib-lm", "kiln-sandbox-candidate",
                                   "kiln-stdlib-lm.candidates", ""]),
                  st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=30))
ids = st.one_of(st.sampled_from(["0" * 32 + ".dir", "d41d8cd98f00b204e9800998ecf8427e.dir", "abc.dir", "x", ""]), names)


def _args(words: list[str], flags: dict[str, st.SearchStrategy[str] | None], positionals=()) -> st.SearchStrategy[list[str]]:
    """``words`` then each flag (with a value drawn from its strategy, or none for a switch) or not,
    now and then twice or with an unknown flag, then the positionals, in a drawn order."""

    @st.composite
    def build(draw) -> list[str]:
        argv: list[str] = []
        for flag, values in flags.items():
            for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
                argv += [flag] if values is None else [flag, draw(values)]
        for values in positionals:
            if draw(st.integers(0, 9)):
                argv.append(draw(values))
        if not draw(st.integers(0, 14)):
            argv.append(draw(st.sampled_from(["--bogus", "--report=", "-h", "--help"])))
        return words + draw(st.permutations(argv)) if draw(st.integers(0, 5)) == 0 else words + argv

    return build()


def good(*values: str, bad: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Half the time a value the command takes, so that examples get past the first check."""
    return st.one_of(st.sampled_from(values), bad)


COMMANDS: dict[str, st.SearchStrategy[list[str]]] = {
    "corpus": _args(["corpus", "build"], {
        "--out": good("new-dir", "dir", "dir/sub", bad=paths), "--shards": good("1", "2", "3", bad=numbers),
        "--seed": good("0", "7", bad=numbers), "--max-bytes": good("65536", "70000", bad=numbers),
        "--poison": st.sampled_from(["null_text", "zero_bytes", "nope", ""])}),
    "corpus-import": _args(["corpus", "import"], {
        "--name": good("mine", "web.text_2", bad=names),
        "--format": good("jsonl", bad=st.sampled_from(["parquet", "text", "csv", ""])),
        "--text-field": good("text", bad=names), "--id-field": good("id", bad=names),
        "--shard-bytes": good("4K", "1M", bad=numbers), "--eval-fraction": good("0.3", "0.5", bad=numbers),
        "--seed": good("0", "7", bad=numbers), "--kind": good("python-source", bad=st.sampled_from(["natural-language", "x"])),
        "--contract": good("stdlib-py@1", "stdlib-py", bad=names), "--root": good("new-dir", "dir", bad=paths),
        "--replace": None}, [good("docs.jsonl", "corpus", "dir", bad=paths)]),
    "snapshot": st.one_of(
        _args(["snapshot", "create"], {"--name": good("stdlib-py", "mine", bad=names), "--no-push": None},
              [good("corpus", bad=paths)]),
        _args(["snapshot", "restore"], {"--to": good("new-dir", "dir", bad=paths)}, [ids]),
        _args(["snapshot", "show"], {}, [ids]),
        _args(["snapshot", "list"], {}),
    ),
    "validate": _args(["validate"], {
        "--contract": good("stdlib-py@1", "stdlib-py", bad=names), "--report": good("new.json", "dir/r.json", bad=paths),
        "--manifest-out": good("m.json", "dir/m.json", bad=paths),
        "--max-quarantine-share": good("0", "0.5", "1", bad=numbers)}, [good("corpus", bad=st.one_of(paths, ids))]),
    "train": st.one_of(
        _args(["train"], {"--recipe": st.one_of(names, paths, st.sampled_from(["tiny", "tiny.toml", "production/small"])),
                          "--manifest": paths, "--run-dir": good("new-dir", bad=paths), "--nnodes": numbers,
                          "--nproc-per-node": numbers, "--max-restarts": numbers, "--max-steps": numbers,
                          "--set": st.sampled_from(["train.steps=5", "train.steps=-1", "x", "=", "train.nope=1",
                                                    "model.n_layer=0", "train.seed=1e9", "optim.lr=nan"])}),
        _args(["evaluate"], {"--checkpoint": paths, "--report": good("new.json", bad=paths), "--manifest": paths,
                             "--max-windows": numbers}),
    ),
    "tokenize": _args(["tokenize"], {
        "--recipe": st.one_of(names, paths, st.sampled_from(["tiny", "tiny-bpe", "production/small"])),
        "--manifest": paths, "--out": good("new-dir", "dir", bad=paths), "--manifest-out": good("m.json", bad=paths),
        "--set": st.sampled_from(["tokenizer.kind=bpe", "tokenizer.kind=nope", "tokenizer.vocab_size=3",
                                  "tokenizer.path=/nonexistent", "model.block_size=0"])}),
    "contract": st.one_of(
        _args(["contract", "init"], {"--from": good("corpus", bad=paths), "--out": good("new.json", "dir/d.json", bad=paths),
                                     "--base": good("web-text@1", "stdlib-py@1", bad=names),
                                     "--text-column": good("text", "source", bad=names), "--version": numbers},
              [good("my-corpus", bad=names)]),
        _args(["contract", "check"], {}, [good("empty.json", "file.txt", bad=paths)]),
    ),
    "registry": st.one_of(
        _args(["promote"], {"--policy": st.sampled_from(["sandbox", "production", "Production", ""]), "--approver": names},
              [names, numbers]),
        _args(["rollback"], {"--policy": st.sampled_from(["sandbox", "production", "x"]), "--actor": names,
                             "--reason": names}, [names]),
        _args(["audit"], {"--policy": st.sampled_from(["sandbox", "production"]), "--json": None,
                           "--require-signed": None}, [names]),
    ),
}


def _tree(root: Path) -> dict[str, str]:
    """Every regular file under ``root`` (not following links, not into KILN_HOME) with its sha256."""
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not (Path(dirpath) == root and d == "home")]
        for name in filenames:
            path = Path(dirpath, name)
            if path.is_file() and not path.is_symlink():
                found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def sample_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kiln.data.corpus import build_corpus

    root = tmp_path_factory.mktemp("generated") / "corpus"
    build_corpus(root, shards=2, seed=3, max_bytes=65_536)
    return root


def populate(root: Path, corpus: Path) -> None:
    """One of each thing a path argument can meet (the two tmpfs links aside)."""
    import shutil

    (root / "file.txt").write_text("not what any command wants\n")
    (root / "docs.jsonl").write_text("".join(f'{{"id": "d{i}", "text": "document {i} of the import examples"}}\n'
                                             for i in range(30)))
    (root / "empty.json").write_text("")
    (root / "dir").mkdir()
    (root / "nonempty").mkdir()
    (root / "nonempty" / "x").write_text("x")
    os.mkfifo(root / "fifo")
    (root / "loop").symlink_to(root / "loop")
    shutil.copytree(corpus, root / "corpus")


def reset(root: Path, corpus: Path) -> None:
    """Undo whatever the last command line did, so that every example meets the same sandbox."""
    import shutil

    for entry in root.iterdir():
        if entry.name in ("full", "ro"):
            for inside in entry.resolve().iterdir():
                if inside.name != "ballast":
                    shutil.rmtree(inside) if inside.is_dir() and not inside.is_symlink() else inside.unlink()
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    populate(root, corpus)


@pytest.fixture()
def sandbox(tmp_path: Path, tmpfs, sample_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The working directory of every generated command line, with ``KILN_HOME`` inside it."""
    root = tmp_path / "sandbox"
    root.mkdir()
    full = tmpfs("64k")
    tmpfs.fill(full)
    (root / "full").symlink_to(full)
    (root / "ro").symlink_to(tmpfs("64k", read_only=True))
    populate(root, sample_corpus)
    monkeypatch.chdir(root)
    monkeypatch.setenv("KILN_HOME", str(root / "home"))
    # An MLflow that is not there, answered at once: the registry commands must say so in one line.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    yield root


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: a usage error (2), or --help (0)
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def check_command_line(root: Path, argv: list[str], outcomes: Counter) -> None:
    before = _tree(root)
    code, out, err = run_cli(argv)
    outcomes[code] += 1
    shown = f"kiln {' '.join(map(repr, argv))} -> {code}\n{err[-2000:]}"
    assert "Traceback" not in out + err, shown
    assert code in (0, 1, 2, 3), shown
    if code:
        errors = [line for line in err.splitlines() if ": error:" in line]
        assert len(errors) == 1 and errors[0].startswith(("kiln: error: ", "kiln ")), shown
    if code in (1, 2):  # a command that did what was asked may rewrite what it was pointed at
        after = _tree(root)
        changed = sorted(p for p in before if after.get(p) != before[p])
        new = sorted(set(after) - set(before))
        assert not changed and not new, f"{shown}\nchanged: {changed}\nleft behind: {new}"


@pytest.mark.parametrize("group", sorted(COMMANDS))
def test_every_generated_command_line_ends_in_its_status_or_one_error_line(group: str, sandbox: Path,
                                                                         sample_corpus: Path) -> None:
    outcomes: Counter = Counter()

    @SETTINGS
    @given(COMMANDS[group])
    def check(argv: list[str]) -> None:
        try:
            check_command_line(sandbox, argv, outcomes)
        finally:
            reset(sandbox, sample_corpus)

    check()
    print(f"{group}: {sum(outcomes.values())} command lines, exit statuses {dict(sorted(outcomes.items()))}")
    assert sum(outcomes.values()) >= min(EXAMPLES, 20)
