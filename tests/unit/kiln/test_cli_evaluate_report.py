"""``kiln evaluate --report`` never lands where it would change its own inputs: a file inside a
committed checkpoint un-commits it (resume falls back to the step before), so the report is refused
there, anywhere in the run's checkpoint tree, on the TrainingManifest and inside the eval corpus,
with exit 2 and one ``error:`` line, before any evaluation and without writing anything."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln_trainer.checkpoint_manifest import canonical_json
from kiln_trainer.training_manifest import TRAINING_MANIFEST_KIND


def _run(tmp_path: Path) -> tuple[Path, Path]:
    step = tmp_path / "run" / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    corpus = tmp_path / "corpus"
    (corpus / "eval").mkdir(parents=True)
    (corpus / "eval" / "eval-00000.parquet").write_bytes(b"PAR1")
    entry = {"path": str(corpus / "eval" / "eval-00000.parquet"), "sha256": "0" * 64, "rows": 1}
    body = {"snapshot_id": "s", "corpus": "c", "contract": "stdlib-py@1", "shards": [entry], "eval_shards": [entry]}
    manifest = {"kind": TRAINING_MANIFEST_KIND, "sha256": hashlib.sha256(canonical_json(body)).hexdigest(), **body}
    (tmp_path / "run" / "training_manifest.json").write_text(json.dumps(manifest))
    return step, corpus


@pytest.mark.parametrize("where", ["step/eval.json", "checkpoints/eval.json", "checkpoints/step-00000005",
                                   "run/training_manifest.json"])
def test_a_report_inside_the_checkpoint_tree_or_on_the_manifest_is_refused(tmp_path: Path, capsys, where: str) -> None:
    step, _ = _run(tmp_path)
    report = {"step": step / "eval.json", "checkpoints": step.parent / where.split("/", 1)[-1],
              "run": tmp_path / "run" / "training_manifest.json"}[where.split("/")[0]]
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    code = main(["evaluate", "--checkpoint", str(step), "--report", str(report)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("kiln evaluate: error: --report ") and str(report) in err[0]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before


def test_a_report_inside_the_eval_corpus_is_refused(tmp_path: Path, capsys) -> None:
    step, corpus = _run(tmp_path)
    code = main(["evaluate", "--checkpoint", str(step), "--report", str(corpus / "eval" / "report.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"lies inside the corpus {corpus}" in err[0]


def test_a_report_through_a_link_into_the_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    step, _ = _run(tmp_path)
    (tmp_path / "reports").symlink_to(step)
    code = main(["evaluate", "--checkpoint", str(step), "--report", str(tmp_path / "reports" / "eval.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "lies inside the checkpoint tree" in err[0]
    assert not (step / "eval.json").exists()


def test_a_report_elsewhere_passes_the_check_and_reaches_the_evaluation(tmp_path: Path, capsys) -> None:
    step, _ = _run(tmp_path)
    code = main(["evaluate", "--checkpoint", str(step), "--report", str(tmp_path / "eval.json")])
    err = capsys.readouterr().err
    assert code != 0 and "--report" not in err  # the fake checkpoint fails later, in the evaluation itself


@pytest.mark.parametrize("argv", [["tokenize", "--recipe", "tiny", "--out", "{corpus}/eval/tokens"],
                                  ["tokenize", "--recipe", "tiny", "--out", "{tmp}/tokens", "--manifest-out",
                                   "{corpus}/m.json"],
                                  ["train", "--recipe", "tiny", "--run-dir", "{corpus}/run"]])
def test_tokenize_and_train_outputs_inside_the_corpus_are_refused(tmp_path: Path, capsys, argv: list[str]) -> None:
    """Packed tokens, a manifest or a run directory written into the corpus would change the corpus the
    manifest's shards come from (its snapshot, the --replace check): refused before anything runs."""
    _, corpus = _run(tmp_path)
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    manifest = tmp_path / "run" / "training_manifest.json"
    line = [a.format(corpus=corpus, tmp=tmp_path) for a in argv] + ["--manifest", str(manifest)]
    code = main(line)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"lies inside the corpus {corpus}" in err[0], err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
