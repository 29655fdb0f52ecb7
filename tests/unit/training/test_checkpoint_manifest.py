"""The commit protocol: verify_checkpoint catches every way a directory can fail to be a checkpoint."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln_trainer.config import load_recipe
from kiln_trainer.contract.checkpoint_manifest import (
    CheckpointError,
    checkpoint_dirs,
    latest_committed,
    manifest_sha256,
    seal,
    verify_checkpoint,
)

from trainer_fixtures import FIXTURE_MODEL, write_checkpoints


@pytest.fixture
def committed(tmp_path: Path) -> Path:
    write_checkpoints(tmp_path, [5])
    return tmp_path / "checkpoints" / "step-00000005"


def test_checkpoint_manifest_is_torch_free() -> None:
    code = ("import sys, kiln_trainer.contract.checkpoint_manifest, kiln_trainer.checkpoint_manifest; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_committed_checkpoint_verifies(committed: Path) -> None:
    manifest = verify_checkpoint(committed)
    assert manifest["kind"] == "kiln.CheckpointManifest"
    assert manifest["step"] == 5 and manifest["world_size"] == 1
    assert set(manifest["files"]) == {
        "model.pt",
        "optimizer.pt",
        "scheduler.pt",
        "trainer_state.pt",
        "rng-rank00000.pt",
        "tokenizer.json",
    }
    assert len(manifest["weights_sha256"]) == 64 and manifest["snapshot_id"] == "abc.dir"
    recipe = load_recipe(None, FIXTURE_MODEL)
    assert manifest["recipe"] == recipe.to_dict() and manifest["recipe_sha256"] == recipe.sha256
    assert len(manifest_sha256(committed)) == 64


def test_missing_manifest(committed: Path) -> None:
    (committed / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint(committed)


def test_tampered_file(committed: Path) -> None:
    path = committed / "model.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="'model.pt' sha256 mismatch"):
        verify_checkpoint(committed)


def test_truncated_file(committed: Path) -> None:
    path = committed / "optimizer.pt"
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="'optimizer.pt' sha256 mismatch"):
        verify_checkpoint(committed)


def test_missing_file(committed: Path) -> None:
    (committed / "rng-rank00000.pt").unlink()
    with pytest.raises(CheckpointError, match="'rng-rank00000.pt' listed in the manifest is missing"):
        verify_checkpoint(committed)


def test_extra_file(committed: Path) -> None:
    (committed / ".model.pt.tmp").write_bytes(b"leftover")
    with pytest.raises(CheckpointError, match="extra files"):
        verify_checkpoint(committed)


def test_partial_state_in_manifest(committed: Path) -> None:
    manifest = json.loads((committed / "manifest.json").read_text())
    del manifest["files"]["optimizer.pt"]
    (committed / "optimizer.pt").unlink()
    (committed / "manifest.json").write_text(json.dumps(seal(manifest)))  # a consistent but partial commit
    with pytest.raises(CheckpointError, match="partial state.*optimizer.pt"):
        verify_checkpoint(committed)


def test_a_swapped_tokenizer_artifact_is_refused(committed: Path) -> None:
    from kiln_trainer.tokenizer import ByteTokenizer

    (committed / "tokenizer.json").write_bytes(ByteTokenizer(eos_id=0).to_bytes())
    with pytest.raises(CheckpointError, match="'tokenizer.json' sha256 mismatch"):
        verify_checkpoint(committed)


def test_a_format_1_checkpoint_still_verifies_with_its_own_file_set(committed: Path) -> None:
    """Checkpoints written before the token data path keep their lineage (registry checks verify them)."""
    manifest = json.loads((committed / "manifest.json").read_text())
    for key in ("token_manifest_sha256", "tokenizer_sha256", "tokenizer"):
        manifest.pop(key)
    manifest["format"] = 1
    del manifest["files"]["tokenizer.json"]
    (committed / "tokenizer.json").unlink()
    (committed / "manifest.json").write_text(json.dumps(seal({k: v for k, v in manifest.items() if k != "seal_sha256"})))
    assert verify_checkpoint(committed)["format"] == 1


def test_world_size_demands_one_rng_file_per_rank(committed: Path) -> None:
    manifest = json.loads((committed / "manifest.json").read_text())
    manifest["world_size"] = 2
    (committed / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(CheckpointError, match="rng-rank00001.pt"):
        verify_checkpoint(committed)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(kind="x"), "kind"),
        (lambda m: m.update(step=6), "directory is step-00000005"),
        (lambda m: m.pop("weights_sha256"), "weights_sha256"),
        (lambda m: m.update(step=True), "'step'"),
        (lambda m: m.pop("tokenizer_sha256"), "tokenizer_sha256"),
        (lambda m: m.pop("token_manifest_sha256"), "token_manifest_sha256"),
        (lambda m: m.update(format=4), "unsupported checkpoint format 4"),
        (lambda m: (m.update(format=3), m.pop("strategy")), "'strategy'"),  # format 3 names its strategy
    ],
)
def test_bad_manifest_fields(committed: Path, edit, message: str) -> None:
    manifest = json.loads((committed / "manifest.json").read_text())
    edit(manifest)
    (committed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(committed)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(created_at=m["created_at"].replace("2", "3", 1)),  # one character, no file hash covers it
        lambda m: m["recipe"].update(extra=1),
        lambda m: m.update(weights_sha256="0" * 64),
        lambda m: m.pop("seal_sha256") and m.update(seal_sha256="0" * 64),
    ],
)
def test_a_manifest_changed_after_it_was_sealed_is_refused(committed: Path, edit) -> None:
    manifest = json.loads((committed / "manifest.json").read_text())
    edit(manifest)
    (committed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="seal mismatch"):
        verify_checkpoint(committed)


def test_a_bit_flip_anywhere_in_the_manifest_file_is_refused(committed: Path) -> None:
    path = committed / "manifest.json"
    original = path.read_bytes()
    for offset in range(0, len(original), max(1, len(original) // 97)):
        for bit in (0, 5):
            flipped = bytearray(original)
            flipped[offset] ^= 1 << bit
            path.write_bytes(bytes(flipped))
            with pytest.raises(CheckpointError):
                verify_checkpoint(committed)
    path.write_bytes(original)
    verify_checkpoint(committed)


def test_unparseable_manifest(committed: Path) -> None:
    (committed / "manifest.json").write_text('{"kind": "kiln.Checkpo')
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        verify_checkpoint(committed)


def test_latest_committed_skips_and_reports_invalid(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert latest_committed(tmp_path) is None
    write_checkpoints(tmp_path, [2, 4, 6])
    root = tmp_path / "checkpoints"
    (root / "step-00000006" / "manifest.json").unlink()  # interrupted save
    (root / "step-00000008").mkdir()  # crashed before writing anything
    (root / "not-a-step").mkdir()
    with caplog.at_level(logging.WARNING):
        assert latest_committed(tmp_path) == root / "step-00000004"
    assert "step 6" in caplog.text and "step 8" in caplog.text
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [2, 4, 6, 8]


def test_manifest_written_last_and_atomically(committed: Path) -> None:
    names = {p.name for p in committed.iterdir()}
    assert not [n for n in names if n.endswith(".tmp")]
    manifest_mtime = os.stat(committed / "manifest.json").st_mtime_ns
    assert all(os.stat(committed / n).st_mtime_ns <= manifest_mtime for n in names)


def test_ranks_verifying_together_each_hash_a_share_and_the_damage_is_found_by_its_owner(committed: Path) -> None:
    from kiln_trainer.contract.checkpoint_manifest import _dealt

    names = json.loads((committed / "manifest.json").read_text())["files"]
    for world in (2, 3, 8):
        shares = [_dealt(committed, names, (rank, world)) for rank in range(world)]
        assert set().union(*shares) == set(names) and sum(len(s) for s in shares) == len(names)  # a partition
    big, small = _dealt(committed, names, (0, 2)), _dealt(committed, names, (1, 2))
    assert ("model.pt" in big) != ("model.pt" in small)  # the largest files go to different ranks
    owner = 0 if "optimizer.pt" in big else 1
    path = committed / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    verify_checkpoint(committed, share=(1 - owner, 2))  # the other rank's share is whole
    with pytest.raises(CheckpointError, match="'optimizer.pt' sha256 mismatch"):
        verify_checkpoint(committed, share=(owner, 2))
    (committed / "rng-rank00000.pt").unlink()  # a missing file is every rank's finding, whoever hashes it
    for rank in (0, 1):
        with pytest.raises(CheckpointError, match="'rng-rank00000.pt' listed in the manifest is missing"):
            verify_checkpoint(committed, share=(rank, 2))


def test_a_checkpoint_records_the_trainer_and_one_sealed_before_the_record_still_verifies(committed: Path) -> None:
    import hashlib
    import importlib.metadata

    from kiln_trainer.contract import canonical_json

    manifest = verify_checkpoint(committed)
    assert manifest["trainer"] == {"spec": "kiln", "distribution": "kiln-trainer",
                                   "version": importlib.metadata.version("kiln-trainer")}
    path = committed / "manifest.json"
    older = {k: v for k, v in manifest.items() if k not in ("trainer", "seal_sha256")}  # as sealed before the record
    path.write_text(json.dumps({**older, "seal_sha256": hashlib.sha256(canonical_json(older)).hexdigest()}))
    assert "trainer" not in verify_checkpoint(committed)
    claimed = {**manifest, "trainer": {**manifest["trainer"], "version": "9.9"}}  # edited after sealing
    path.write_text(json.dumps(claimed))
    with pytest.raises(CheckpointError, match="seal mismatch"):
        verify_checkpoint(committed)
    path.write_text(json.dumps(seal({**manifest, "trainer": "kiln"})))
    with pytest.raises(CheckpointError, match="field 'trainer' must be an object"):
        verify_checkpoint(committed)
    user = {**older, "recipe": {**older["recipe"], "trainer": "my_lm.train:main"}}
    assert seal(user)["trainer"] == {"spec": "my_lm.train:main", "distribution": "", "version": ""}
