"""Held-out bits-per-byte of a committed checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from kiln_trainer import evaluate
from kiln_trainer.checkpoint_manifest import CheckpointError, manifest_sha256
from trainer_fixtures import write_checkpoints


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("eval-run")
    write_checkpoints(run_dir, [3])
    return run_dir / "checkpoints" / "step-00000003"


def test_report_is_finite_deterministic_and_bounded(step_dir: Path, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    assert (
        evaluate.main(
            ["--checkpoint", str(step_dir), "--manifest", str(corpus), "--out", str(out), "--max-windows", "16"]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["kind"] == "kiln.EvalReport" and report["split"] == "eval"
    assert report["checkpoint"] == str(step_dir.resolve())
    assert report["checkpoint_manifest_sha256"] == manifest_sha256(step_dir)
    assert math.isfinite(report["bits_per_byte"]) and report["bits_per_byte"] > 0
    assert report["bits_per_byte"] == pytest.approx(report["loss"] / math.log(2))
    assert report["windows"] == 16 and report["tokens"] == 16 * 8  # block_size 8 in the fixture model
    again = evaluate.evaluate_checkpoint(step_dir, corpus, max_windows=16)
    assert again["bits_per_byte"] == report["bits_per_byte"]
    assert again["weights_sha256"] == report["weights_sha256"]


def test_tampered_checkpoint_is_refused(step_dir: Path, corpus: Path, tmp_path: Path) -> None:
    copy = tmp_path / "checkpoints" / step_dir.name
    shutil.copytree(step_dir, copy)
    with open(copy / "model.pt", "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(CheckpointError, match="model.pt"):
        evaluate.evaluate_checkpoint(copy, corpus)
    assert evaluate.main(["--checkpoint", str(copy), "--manifest", str(corpus), "--out", str(tmp_path / "e.json")]) == 2
    assert not (tmp_path / "e.json").exists()


def test_without_a_manifest_the_run_copy_is_required(step_dir: Path) -> None:
    from kiln_trainer.errors import ManifestError

    with pytest.raises(ManifestError, match="training_manifest.json does not exist"):
        evaluate.evaluate_checkpoint(step_dir)
