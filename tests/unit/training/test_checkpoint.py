"""Checkpoint state: weights hash, RNG capture/restore, optimizer round trip, retention, async writer."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln_trainer.checkpoint import (
    CheckpointIdentity,
    CheckpointWriter,
    apply_retention,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    weights_sha256,
)
from kiln_trainer.checkpoint_manifest import CheckpointError, checkpoint_dirs, latest_committed, verify_checkpoint
from kiln_trainer.config import ModelConfig, Recipe
from kiln_trainer.errors import StorageError
from kiln_trainer.model import GPT

from trainer_fixtures import write_checkpoints


def test_weights_hash_is_deterministic_and_sensitive() -> None:
    torch.manual_seed(0)
    a = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=257)).state_dict()
    b = {k: v.clone() for k, v in reversed(list(a.items()))}  # other order, other storage
    assert weights_sha256(a) == weights_sha256(b)
    b["lm_head.weight"][0, 0] += 1e-7
    assert weights_sha256(a) != weights_sha256(b)
    c = {k: v.to(torch.bfloat16) for k, v in a.items()}  # dtype is part of the identity
    assert weights_sha256(c) != weights_sha256(a)


def test_rng_round_trip_covers_python_numpy_torch() -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_full_state_round_trip_with_weights_only(tmp_path: Path) -> None:
    write_checkpoints(tmp_path, [3])
    ck = load_checkpoint(tmp_path / "checkpoints" / "step-00000003", rank=0)
    state = ck.optimizer["state"]
    # The Adam moments come back (a fresh optimizer's state_dict would have none).
    assert state and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in state.values())
    model = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=257))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.load_state_dict(ck.model)
    optimizer.load_state_dict(ck.optimizer)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], state[0]["exp_avg"])
    assert weights_sha256(model.state_dict()) == ck.manifest["weights_sha256"]
    assert ck.trainer_state == {"step": 3} and ck.rng is not None
    # A rank the checkpoint's world did not have (a resume at a larger world size) gets no RNG state.
    assert load_checkpoint(tmp_path / "checkpoints" / "step-00000003", rank=1).rng is None


def test_checkpoint_holds_the_tokenizer_and_its_identity(tmp_path: Path) -> None:
    from kiln_trainer.tokenizer import ByteTokenizer, load_tokenizer

    write_checkpoints(tmp_path, [2])
    step_dir = tmp_path / "checkpoints" / "step-00000002"
    manifest = verify_checkpoint(step_dir)
    assert manifest["format"] == 2 and "tokenizer.json" in manifest["files"]
    assert manifest["tokenizer_sha256"] == ByteTokenizer().sha256 == load_tokenizer(step_dir / "tokenizer.json").sha256
    assert manifest["tokenizer"] == ByteTokenizer().describe() and manifest["token_manifest_sha256"] == "1" * 64


def test_retention_keeps_last_k_and_never_the_newest(tmp_path: Path) -> None:
    write_checkpoints(tmp_path, [1, 2, 3, 4, 5], keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000005"]
    # A leftover older than the newest commit is garbage; a newer uncommitted dir is left alone.
    (root / "step-00000003").mkdir()
    (root / "step-00000009").mkdir()
    apply_retention(tmp_path, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005", "step-00000009"]
    assert latest_committed(tmp_path) == root / "step-00000005"


def test_async_writer_snapshots_state_before_training_continues(tmp_path: Path) -> None:
    recipe = Recipe()
    writer = CheckpointWriter(
        tmp_path,
        CheckpointIdentity(
            world_size=1,
            recipe=recipe.to_dict(),
            recipe_sha256=recipe.sha256,
            snapshot_id="s",
            training_manifest_sha256="0" * 64,
        ),
        keep_last=3,
        async_save=True,
    )
    model = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=257))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    expected = weights_sha256(model.state_dict())
    writer.save(step=1, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={}, rng_blobs=[b"x"])
    with torch.no_grad():  # "training continues" while the writer runs
        for p in model.parameters():
            p.add_(1.0)
    writer.close()
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-00000001")["weights_sha256"] == expected
    assert writer.last_committed_step == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("ckpt-writer")]


def test_writer_refuses_to_overwrite_a_commit_and_reports_failures(tmp_path: Path) -> None:
    writer = write_checkpoints(tmp_path, [1])
    writer = CheckpointWriter(tmp_path, writer.identity, keep_last=3, async_save=True)
    model = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=257))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    writer.save(step=1, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={}, rng_blobs=[b"x"])
    with pytest.raises(CheckpointError, match="already committed"):
        writer.wait()  # the background failure surfaces on the next wait/save
    writer.close()


def test_writer_moves_a_damaged_commit_aside_and_writes_the_step_again(tmp_path: Path, caplog) -> None:
    """Resume skipped a damaged newest checkpoint; when training reaches its step again the writer
    must not stop the run on it (found by the chaos suite), nor delete the evidence."""
    writer = write_checkpoints(tmp_path, [1])
    damaged = tmp_path / "checkpoints" / "step-00000001"
    model_file = damaged / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: the manifest still parses, the hash does not match
    model_file.write_bytes(bytes(data))
    writer = CheckpointWriter(tmp_path, writer.identity, keep_last=3, async_save=True)
    model = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=257))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    with caplog.at_level("WARNING"):
        writer.save(step=1, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={}, rng_blobs=[b"x"])
        writer.close()
    assert verify_checkpoint(damaged)["weights_sha256"] == weights_sha256(model.state_dict())
    aside = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-00000001.damaged-")]
    assert len(aside) == 1 and (aside[0] / "model.pt").read_bytes() == bytes(data)
    assert "fails verification" in caplog.text and "moved aside" in caplog.text
    assert [d.name for _, d in checkpoint_dirs(tmp_path)] == ["step-00000001"]


def test_a_checkpoint_that_does_not_fit_on_the_disk_is_a_storage_error_and_leaves_no_step_dir(tmpfs) -> None:
    """A full disk is a fault the trainer reports (exit 2) naming the file, not a crash torchrun
    restarts into the same wall; the partial step is removed, the committed one before it kept."""
    run_dir = tmpfs("256k")  # step 1 of the fixture model (~90 kB) fits; the wider model's step 2 (~1.4 MB) does not
    committed = write_checkpoints(run_dir, [1])
    writer = CheckpointWriter(run_dir, committed.identity, keep_last=3, async_save=True)
    model = GPT(ModelConfig(n_layer=2, n_head=1, n_embd=64, block_size=8, vocab_size=257))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    writer.save(step=2, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={}, rng_blobs=[b"x"])
    with pytest.raises(StorageError, match=r"checkpoint of step 2 not written: .*step-00000002/\S+: No space left on device"):
        writer.wait()
    writer.close()
    assert [d.name for _, d in checkpoint_dirs(run_dir)] == ["step-00000001"]
    verify_checkpoint(latest_committed(run_dir))
