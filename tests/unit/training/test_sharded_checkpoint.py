"""Sharded checkpoints (format 3, ``parallel.strategy = "fsdp"``): the commit rule, verification,
consolidation for evaluation and export, and loading that runs no pickled code -- on real FSDP2
checkpoints written by the trainer's own writer (one rank, in this process)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from kiln_trainer.checkpoint import load_model_weights, weights_sha256
from kiln_trainer.checkpoint_manifest import latest_committed, seal, sha256_file, verify_checkpoint
from kiln_trainer.errors import CheckpointError, StorageError

from trainer_fixtures import write_sharded_checkpoints


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("sharded") / "run"
    write_sharded_checkpoints(run_dir, [2, 4], keep_last=2)
    return run_dir


@pytest.fixture()
def committed(sharded_run: Path, tmp_path: Path) -> Path:
    """A private copy of the run's step-4 checkpoint, free to damage."""
    import shutil

    target = tmp_path / "run" / "checkpoints" / "step-00000004"
    shutil.copytree(sharded_run / "checkpoints" / "step-00000004", target)
    return target


def _reseal(step_dir: Path, **changes: object) -> None:
    """Rewrite the manifest as a forger who can also rewrite manifest.json would (hashes and seal
    matching the damaged files): what is left to stop them is the loader itself."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest.pop("seal_sha256")
    manifest["files"] = {name: sha256_file(step_dir / name) for name in manifest["files"]}
    manifest.update(changes)
    (step_dir / "manifest.json").write_text(json.dumps(seal(manifest)))


class _Runs:
    """Unpickling this runs a shell command that leaves a file behind: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_every_rank_file_and_the_dcp_index_are_committed_by_the_manifest_written_last(sharded_run: Path) -> None:
    for step in (2, 4):
        step_dir = sharded_run / "checkpoints" / f"step-{step:08d}"
        manifest = verify_checkpoint(step_dir)
        assert manifest["format"] == 3 and manifest["strategy"] == "fsdp" and manifest["world_size"] == 1
        assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "scheduler.pt", "trainer_state.pt",
                                          "rng-rank00000.pt", "tokenizer.json"}
        # The weights hash is the hash of the whole model, as for a ddp checkpoint of the same weights.
        _, state = load_model_weights(step_dir)
        assert weights_sha256(state) == manifest["weights_sha256"]
        assert {"transformer.wte.weight", "lm_head.weight"} <= set(state)
    assert latest_committed(sharded_run).name == "step-00000004"
    step2, step4 = (load_model_weights(sharded_run / "checkpoints" / f"step-{s:08d}")[1] for s in (2, 4))
    assert not torch.equal(step2["lm_head.weight"], step4["lm_head.weight"])  # a real step between them


def test_dcp_files_without_kilns_manifest_are_not_a_checkpoint(committed: Path) -> None:
    (committed / "manifest.json").unlink()
    assert (committed / ".metadata").is_file()  # DCP considers this a finished checkpoint; kiln does not
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint(committed)
    assert latest_committed(committed.parents[1]) is None


def test_a_flipped_byte_in_a_shard_is_refused_naming_it(committed: Path) -> None:
    shard = committed / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="'__0_0.distcp' sha256 mismatch"):
        verify_checkpoint(committed)
    with pytest.raises(CheckpointError, match="__0_0.distcp"):
        load_model_weights(committed)


def test_a_shard_of_a_rank_outside_the_world_or_no_shard_at_all_is_refused(committed: Path) -> None:
    (committed / "__1_0.distcp").write_bytes((committed / "__0_0.distcp").read_bytes())
    with pytest.raises(CheckpointError, match=r"extra files not in the manifest \['__1_0.distcp'\]"):
        verify_checkpoint(committed)
    _reseal(committed)  # listed now, but rank 1 is not of a world of one
    manifest = json.loads((committed / "manifest.json").read_text())
    manifest["files"]["__1_0.distcp"] = sha256_file(committed / "__1_0.distcp")
    manifest.pop("seal_sha256")
    (committed / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(CheckpointError, match=r"unexpected files \['__1_0.distcp'\]"):
        verify_checkpoint(committed)
    for name in ("__0_0.distcp", "__1_0.distcp"):
        (committed / name).unlink()
        manifest["files"].pop(name)
    (committed / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(CheckpointError, match="lists no DCP data file"):
        verify_checkpoint(committed)


def test_a_forged_dcp_index_runs_no_code_even_with_a_matching_manifest(committed: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "ran"
    (committed / ".metadata").write_bytes(pickle.dumps(_Runs(marker)))
    _reseal(committed)
    verify_checkpoint(committed)  # the forger matched every hash
    with pytest.raises(CheckpointError, match=r"refusing to unpickle posix\.system"):
        load_model_weights(committed)
    assert not marker.exists()
    # What the allow-list closes: DCP's own reader executes the same file (then chokes on its result).
    with pytest.raises(AttributeError):
        FileSystemReader(committed).read_metadata()
    assert marker.exists()


def test_a_forged_non_tensor_value_runs_no_code(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from kiln_trainer.sharded_checkpoint import _dcp_load

    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "step": _Runs(marker)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="Weights only load failed|Unsupported global"):
        _dcp_load({"w": torch.zeros(2), "step": None}, tmp_path / "ck", no_dist=True)
    assert not marker.exists()
    # DCP's default planner unpickles the value with weights_only=False: the gap SafeLoadPlanner closes.
    dcp.load({"w": torch.zeros(2), "step": None}, storage_reader=FileSystemReader(tmp_path / "ck"),
             planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.exists()


def test_evaluation_and_export_read_the_consolidated_model(committed: Path) -> None:
    from kiln_trainer.evaluate import load_checkpoint_model

    model, manifest = load_checkpoint_model(committed)
    assert weights_sha256(model.state_dict()) == manifest["weights_sha256"]
    assert model.transformer.wte.weight is model.lm_head.weight  # tied, as trained


def test_a_full_disk_fails_the_save_with_a_storage_error_and_keeps_the_last_checkpoint(tmpfs) -> None:
    # Synchronous saves, so that step 2 is committed before the disk fills (an asynchronous one
    # would be the one to fail, at the next save's wait: the same error, one step earlier).
    disk = tmpfs(size="1m")
    run_dir = disk / "run"
    with pytest.raises(StorageError, match="checkpoint of step 4 not written: .*No space left"):
        write_sharded_checkpoints(run_dir, [2, 4], async_save=False,
                                  before_save=lambda step: step == 4 and tmpfs.fill(disk))
    assert latest_committed(run_dir).name == "step-00000002"
    verify_checkpoint(run_dir / "checkpoints" / "step-00000002")
    assert not (run_dir / "checkpoints" / "step-00000004").exists()  # its partial shards gave their space back


def test_keep_last_k_applies_to_sharded_checkpoints(tmp_path: Path) -> None:
    write_sharded_checkpoints(tmp_path / "run", [2, 4, 6], keep_last=2)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]
