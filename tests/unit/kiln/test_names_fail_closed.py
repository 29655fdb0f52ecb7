"""Every name kiln checks with an anchored pattern is checked whole: ``re.match`` with ``^…$`` lets a
trailing newline through (``$`` also matches before a final ``\\n``), so "prose\\n" passed as a corpus
name, and a snapshot id, model name, contract name or Slurm partition with one appended did too.
Each check now uses ``fullmatch``; these are its regression tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import ConfigError, PolicyError, SnapshotError


def test_a_corpus_name_with_a_trailing_newline_is_refused(home) -> None:
    from kiln.data.snapshot import create_snapshot

    with pytest.raises(SnapshotError, match=r"corpus name 'prose\\n' is not valid"):
        create_snapshot(home / "anywhere", name="prose\n")


def test_a_snapshot_id_with_a_trailing_newline_is_refused(home) -> None:
    from kiln.data.snapshot import show_snapshot

    with pytest.raises(SnapshotError, match="is not a snapshot id"):
        show_snapshot("0" * 32 + ".dir\n")


@pytest.mark.parametrize("field", ["corpus", "model"])
def test_production_config_names_with_a_trailing_newline_are_refused(field: str) -> None:
    from kiln.policy import ProductionConfig

    values = {"corpus": "stdlib-py", "contract": "stdlib-py@1", "model": "kiln-stdlib-lm"}
    values[field] += "\n"
    with pytest.raises(PolicyError, match=f"{field} "):
        ProductionConfig(**values)


def test_a_contract_named_with_a_trailing_newline_is_a_problem() -> None:
    from kiln.data.contracts import contract_problems

    problems = contract_problems({"name": "web-text\n", "expectations": []})
    assert any(p.startswith("name must be a contract name") for p in problems), problems


def test_a_slurm_partition_with_a_trailing_newline_never_reaches_the_batch_script(tmp_path: Path) -> None:
    from kiln.launchers import LaunchSpec, render_sbatch

    spec = LaunchSpec(run_dir=tmp_path, manifest=tmp_path / "m.json", recipe=tmp_path / "r.toml", run_key="k/r")
    with pytest.raises(ConfigError, match="slurm partition must be a plain Slurm name"):
        render_sbatch(spec, partition="prod\n")


def test_a_step_directory_name_with_a_trailing_newline_is_no_checkpoint(tmp_path: Path) -> None:
    from kiln_trainer.checkpoint_manifest import CHECKPOINTS_SUBDIR, checkpoint_dirs

    (tmp_path / CHECKPOINTS_SUBDIR / "step-00000010\n").mkdir(parents=True)
    (tmp_path / CHECKPOINTS_SUBDIR / "step-00000020").mkdir()
    assert [(step, p.name) for step, p in checkpoint_dirs(tmp_path)] == [(20, "step-00000020")]


def test_a_document_rule_id_with_a_trailing_newline_is_a_problem() -> None:
    from kiln.data.doc_rules import check_document_rules

    problems = check_document_rules([{"rule": "pii\n", "kind": "kiln.pii", "params": {}}])
    assert problems and "must be an id like" in problems[0], problems
