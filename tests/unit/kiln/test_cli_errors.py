"""Operating-system errors at the command line, through the real ``kiln`` CLI in a subprocess.

A target kiln cannot use (a file where a directory is expected, a read-only disk) is a usage error
found before any work: exit 2. A disk that fills up during the work is a fault: exit 1. Either way
stderr carries exactly one ``kiln <command>: error:`` line naming the path and the cause, never a
traceback, and nothing is left that claims something false: no half corpus or restore that looks
whole, no torn file, no status saying RUNNING for a job that is gone.

Full and read-only disks are real: a small tmpfs per test (the ``tmpfs`` fixture, tests/unit/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln import settings as kiln_settings

from trainer_fixtures import REPO, stdlib_sources, trainer_env, write_shard, write_training_manifest

FULL = "No space left on device"
READ_ONLY = "Read-only file system"
FAST = ("train.steps=8", "checkpoint.every_steps=4", "optim.warmup_steps=2", "train.log_every=4")


def kiln(*argv: str, home: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = trainer_env()
    if home is not None:
        env["KILN_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "kiln.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout)


def assert_one_error(proc: subprocess.CompletedProcess[str], command: str, code: int, *names: str) -> str:
    """Exit ``code``, no traceback, exactly one error line (``kiln <command>: error: ...``) naming ``names``."""
    everything = proc.stdout + proc.stderr
    assert "Traceback" not in everything, everything[-4000:]
    errors = [line for line in proc.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"kiln {command}: error: "), proc.stderr[-4000:]
    for name in names:
        assert name in errors[0], errors[0]
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    return errors[0]


def tree_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# -------------------------------------------------------------------------------------- the class
def test_an_os_error_that_escapes_a_subcommand_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys):
    """The class: an OSError no subcommand wrapped itself still ends in one line naming the path, exit 1."""
    from kiln.cli import main
    from kiln.cli import snapshot as cli_snapshot

    missing = tmp_path / "gone" / "records.json"
    monkeypatch.setattr(cli_snapshot, "_list", lambda _args: missing.read_text())
    assert main(["snapshot", "list"]) == 1
    err = capsys.readouterr().err
    assert err == f"kiln snapshot list: error: {missing}: No such file or directory\n"


# ---------------------------------------------------------------------------------- train, evaluate
@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-errors-corpus")
    docs = stdlib_sources(150_000)
    shards = [write_shard(root / "train-00000.parquet", docs[:-2])]
    return write_training_manifest(root / "manifest.json", shards, [write_shard(root / "eval-00000.parquet", docs[-2:])])


def train_argv(manifest: Path, run_dir: Path, *extra: str) -> list[str]:
    argv = ["train", "--recipe", "tiny", "--manifest", str(manifest), "--run-dir", str(run_dir), *extra]
    for item in FAST:
        argv += ["--set", item]
    return argv


def test_train_into_a_file_is_a_usage_error(manifest, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.write_text("a file")
    assert_one_error(kiln(*train_argv(manifest, run_dir)), "train", 2, str(run_dir), "not a directory")


def test_train_onto_a_read_only_disk_is_a_usage_error(manifest, tmpfs):
    run_dir = tmpfs(read_only=True) / "run"
    assert_one_error(kiln(*train_argv(manifest, run_dir)), "train", 2, str(run_dir), READ_ONLY)


@pytest.mark.parametrize("flag, value", [("--nnodes", "0"), ("--nproc-per-node", "0"), ("--max-restarts", "-1"),
                                         ("--max-steps", "0"), ("--nnodes", "two")])
def test_train_numeric_flags_out_of_range_are_usage_errors(manifest, tmp_path, flag, value):
    proc = kiln(*train_argv(manifest, tmp_path / "run", flag, value))
    assert_one_error(proc, "train", 2, f"argument {flag}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_evaluate_max_windows_must_be_a_positive_integer(tmp_path, value):
    proc = kiln("evaluate", "--checkpoint", str(tmp_path), "--report", str(tmp_path / "e.json"), "--max-windows", value)
    assert_one_error(proc, "evaluate", 2, "argument --max-windows")


def test_evaluate_report_target_is_checked_before_the_evaluation(tmp_path, tmpfs):
    # The checkpoint is not one: an evaluation that ran first would fail on it (exit 1) instead.
    a_dir = tmp_path / "report.json"
    a_dir.mkdir()
    proc = kiln("evaluate", "--checkpoint", str(tmp_path), "--report", str(a_dir))
    assert_one_error(proc, "evaluate", 2, "--report", str(a_dir), "is a directory")
    read_only = tmpfs(read_only=True) / "eval.json"
    proc = kiln("evaluate", "--checkpoint", str(tmp_path), "--report", str(read_only))
    assert_one_error(proc, "evaluate", 2, "--report", str(read_only), READ_ONLY)


@pytest.mark.slow
def test_evaluate_onto_a_full_disk_writes_no_report(manifest, tmp_path, tmpfs):
    run_dir = tmp_path / "run"
    trained = kiln(*train_argv(manifest, run_dir))
    assert trained.returncode == 0, trained.stderr[-3000:]
    checkpoint = json.loads(trained.stdout)["checkpoint"]
    disk = tmpfs("256k")
    tmpfs.fill(disk)  # no room left for the report
    report = disk / "eval.json"
    proc = kiln("evaluate", "--checkpoint", checkpoint, "--report", str(report), "--max-windows", "4")
    assert_one_error(proc, "evaluate", 1, str(report), FULL)
    assert sorted(p.name for p in disk.iterdir()) == ["ballast"]  # no report, no temp file


# ---------------------------------------------------------------------------------- corpus build
def test_corpus_build_into_a_file_is_a_usage_error(tmp_path):
    out = tmp_path / "corpus"
    out.write_text("not a directory")
    assert_one_error(kiln("corpus", "build", "--out", str(out)), "corpus build", 2, str(out), "not a directory")
    assert out.read_text() == "not a directory"


def test_corpus_build_on_a_read_only_disk_is_a_usage_error(tmpfs):
    out = tmpfs(read_only=True) / "corpus"
    assert_one_error(kiln("corpus", "build", "--out", str(out)), "corpus build", 2, str(out), READ_ONLY)


def test_corpus_build_on_a_full_disk_leaves_nothing_behind(tmpfs):
    disk = tmpfs("256k")  # the default corpus is ~1.3 MB of Parquet
    out = disk / "corpus"
    assert_one_error(kiln("corpus", "build", "--out", str(out)), "corpus build", 1, str(out), FULL)
    assert list(disk.iterdir()) == []  # no half corpus, no staging folder


def test_corpus_rebuild_on_a_full_disk_keeps_the_old_corpus_whole(tmpfs):
    out = tmpfs("512k") / "corpus"
    first = kiln("corpus", "build", "--out", str(out), "--shards", "2", "--max-bytes", "100000")
    assert first.returncode == 0, first.stderr
    (out / "train" / "NOTES.txt").write_text("not a shard: a rebuild keeps it")
    before = tree_hashes(out)
    assert_one_error(kiln("corpus", "build", "--out", str(out)), "corpus build", 1, str(out), FULL)
    assert tree_hashes(out) == before
    assert sorted(p.name for p in out.iterdir()) == ["corpus.json", "eval", "train"]
    # With room again, the rebuild replaces the shards and carries the foreign file over.
    again = kiln("corpus", "build", "--out", str(out), "--shards", "3", "--max-bytes", "100000")
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (out / "train").iterdir()) == [
        "NOTES.txt", "shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]


# ------------------------------------------------------------------------------ snapshot restore
@pytest.fixture()
def snapshot_id(home) -> str:
    from kiln.data.snapshot import create_snapshot

    corpus = kiln_settings.load().corpus_root / "demo"
    (corpus / "train").mkdir(parents=True)
    for i in range(3):  # 600 kB: more than the tmpfs below holds
        (corpus / "train" / f"shard-{i:05d}.parquet").write_bytes(hashlib.sha256(bytes([i])).digest() * 6250)
    return create_snapshot(corpus).id


def test_restore_into_a_file_is_a_usage_error(home, snapshot_id, tmp_path):
    target = tmp_path / "file"
    target.write_text("keep")
    proc = kiln("snapshot", "restore", snapshot_id, "--to", str(target), home=home)
    assert_one_error(proc, "snapshot restore", 2, str(target), "not a directory")
    assert target.read_text() == "keep"


def test_restore_onto_a_read_only_disk_is_a_usage_error(home, snapshot_id, tmpfs):
    target = tmpfs(read_only=True) / "restored"
    proc = kiln("snapshot", "restore", snapshot_id, "--to", str(target), home=home)
    assert_one_error(proc, "snapshot restore", 2, str(target), READ_ONLY)


@pytest.mark.parametrize("slack", [0, 8192], ids=["refused-up-front", "disk-fills-mid-restore"])
def test_restore_onto_a_full_disk_leaves_nothing_behind(home, snapshot_id, tmpfs, slack):
    # slack 8192: the space check passes, DVC's scratch repository and page rounding then fill it.
    disk = tmpfs("256k" if not slack else str(600_000 + slack))
    target = disk / "restored"
    proc = kiln("snapshot", "restore", snapshot_id, "--to", str(target), home=home)
    assert_one_error(proc, "snapshot restore", 1, str(target), FULL)
    assert list(disk.iterdir()) == []  # neither a partial restore nor DVC's scratch copy


# -------------------------------------------------------------------- a full disk during training
@pytest.mark.slow
def test_a_disk_that_fills_during_training_ends_in_a_truthful_fatal_status(manifest, tmpfs):
    # 1 MiB: the launch state and the first steps fit, the step-4 checkpoint (~1 MB) does not.
    run_dir = tmpfs("1m") / "run"
    proc = kiln(*train_argv(manifest, run_dir))
    line = assert_one_error(proc, "train", 1, str(run_dir), FULL)
    assert "StorageError" in line and "exited 2 (trainer fault, not retried)" in line
    launch = run_dir / ".launch"
    status = json.loads((launch / "status.json").read_text())
    assert status["state"] == "FATAL" and FULL in status["reason"]
    assert sorted(p.name for p in launch.iterdir() if p.name.endswith(".tmp")) == []  # no torn status.json
    assert not (run_dir / "result.json").exists()
    assert list((run_dir / "checkpoints").iterdir()) == []  # the partial step-4 checkpoint is gone


@pytest.mark.slow
def test_a_disk_already_full_leaves_every_record_truthful(manifest, tmpfs):
    """The disk stays full from the job's first second on, so nothing the trainer frees makes room
    again: the fatal marker and status.json must still end up saying what happened."""
    disk = tmpfs("1m")
    run_dir = disk / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", *train_argv(manifest, run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=trainer_env(), cwd=REPO)
    status_file = run_dir / ".launch" / "status.json"
    try:
        deadline = time.monotonic() + 120  # a safety net, not a timing assertion
        while not (status_file.is_file() and "RUNNING" in status_file.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the job never reached RUNNING"
            time.sleep(0.05)
        tmpfs.fill(disk)  # before the trainer writes a byte
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = assert_one_error(done, "train", 1, str(run_dir), FULL)
    assert "StorageError" in line
    status = json.loads(status_file.read_text())
    assert status["state"] == "FATAL" and FULL in status["reason"], status
    assert [p.name for p in (run_dir / ".launch").iterdir() if p.name.endswith(".tmp")] == []
    assert not (run_dir / "result.json").exists()


# ------------------------------------------------------------------------------------ bad recipes
@pytest.mark.parametrize("setting, field", [
    (("--set", "train.no_such_field=1"), "train.no_such_field"),
    (("--set", "model.n_layer=four"), "model.n_layer"),
    (("--set", "nosection=1"), "nosection=1"),
])
def test_a_bad_recipe_is_refused_before_any_worker_starts(manifest, tmp_path, setting, field):
    proc = kiln(*train_argv(manifest, tmp_path / "run", *setting), timeout=60)
    line = assert_one_error(proc, "train", 2, "tiny.toml", field)
    assert "[node" not in proc.stderr and "[launcher]" not in proc.stderr, proc.stderr  # nothing was launched
    assert not (tmp_path / "run").exists(), line


def test_a_bad_recipe_file_is_named_with_its_bad_section(manifest, tmp_path):
    recipe = tmp_path / "typo.toml"
    recipe.write_text("[modle]\nn_layer = 2\n")
    argv = ["train", "--recipe", str(recipe), "--manifest", str(manifest), "--run-dir", str(tmp_path / "run")]
    assert_one_error(kiln(*argv, timeout=60), "train", 2, str(recipe), "modle")
