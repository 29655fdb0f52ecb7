"""``kiln_trainer.contract``: the facts kiln and its trainer share, written once. The hash of a fixed
TrainingManifest is a literal computed before the contract existed, so the wire format cannot change
unnoticed (every manifest already issued keeps its hash)."""

from __future__ import annotations

import ast
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from kiln_trainer import contract
from kiln_trainer.contract import (
    TRAINING_MANIFEST_KIND,
    atomic_write_bytes,
    canonical_json,
    sha256_file,
    step_dir_name,
    training_manifest_sha256,
)
from kiln_trainer.contract.training_manifest import load_training_manifest
from kiln_trainer.errors import TrainingManifestError

FIXED_MANIFEST = {
    "snapshot_id": "0123456789abcdef0123456789abcdef.dir",
    "corpus": "web-ü",
    "contract": "web@1",
    "shards": [{"path": "/data/train/part-0.parquet", "sha256": "a" * 64, "rows": 10},
               {"path": "/data/train/part-1.parquet", "sha256": "b" * 64, "rows": 4, "drop_rows": [0, 3]}],
    "eval_shards": [{"path": "/data/eval/part-0.parquet", "sha256": "c" * 64, "rows": 2}],
    "quarantined": ["/data/train/bad.parquet"],
}
FIXED_SHA256 = "d650c8182129809f19460721bbacfadeada6ee531b5e03aa90955cce286ab47c"
"""kiln.refs.TrainingManifest.build(**FIXED_MANIFEST).sha256, computed before the contract owned the rule."""
FIXED_TOKENS = {"manifest": "/data/tokens/token_manifest.json", "sha256": "d" * 64}
FIXED_WITH_TOKENS_SHA256 = "d2d277bafdda9e5a80304634a17c2d069ef26d53904e91b7c3c075c1fc2fccc5"


def test_canonical_json_sorts_keys_drops_spaces_and_keeps_utf8():
    assert canonical_json({"b": [1, 2], "a": "ü"}) == '{"a":"ü","b":[1,2]}'.encode()


def test_canonical_json_refuses_a_lone_surrogate_no_utf8_file_can_hold():
    with pytest.raises(UnicodeEncodeError):
        canonical_json({"corpus": "\ud800"})


def test_the_hash_of_a_fixed_manifest_is_the_one_it_always_had():
    assert training_manifest_sha256(FIXED_MANIFEST) == FIXED_SHA256
    assert training_manifest_sha256({**FIXED_MANIFEST, "tokens": FIXED_TOKENS}) == FIXED_WITH_TOKENS_SHA256


def test_kind_and_sha256_are_outside_the_hash_and_every_other_key_is_in_it():
    wire = {"kind": TRAINING_MANIFEST_KIND, **FIXED_MANIFEST, "sha256": "0" * 64}
    assert training_manifest_sha256(wire) == FIXED_SHA256
    assert training_manifest_sha256({**FIXED_MANIFEST, "corpus": "web-u"}) != FIXED_SHA256
    assert training_manifest_sha256({**FIXED_MANIFEST, "extra": None}) != FIXED_SHA256


def test_the_trainers_reader_verifies_a_manifest_under_the_contracts_hash(tmp_path: Path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"kind": TRAINING_MANIFEST_KIND, **FIXED_MANIFEST, "sha256": FIXED_SHA256}))
    assert load_training_manifest(path).sha256 == FIXED_SHA256
    path.write_text(json.dumps({"kind": TRAINING_MANIFEST_KIND, **FIXED_MANIFEST, "corpus": "x", "sha256": FIXED_SHA256}))
    with pytest.raises(TrainingManifestError, match="content hash mismatch"):
        load_training_manifest(path)


def test_step_dir_name_pads_the_step_to_eight_digits():
    assert step_dir_name(50) == "step-00000050"
    with pytest.raises(ValueError, match="step is >= 0"):
        step_dir_name(-1)


def test_sha256_file_is_the_hash_of_the_bytes(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"abc")
    assert sha256_file(tmp_path / "f") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    with pytest.raises(FileNotFoundError):
        sha256_file(tmp_path / "missing")


def test_atomic_write_replaces_the_whole_file_with_the_mode_asked(tmp_path: Path):
    target = tmp_path / "sub" / "result.json"
    atomic_write_bytes(target, b"old")
    atomic_write_bytes(target, b"new", mode=0o640)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(os.listdir(target.parent)) == ["result.json"]


def test_a_failed_atomic_write_leaves_what_was_there_and_no_temporary_file(tmp_path: Path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_bytes(b"kept")
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"new")  # a rename cannot replace a non-empty directory
    assert (target / "inside").read_bytes() == b"kept"
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def test_the_contract_imports_the_standard_library_and_its_two_stdlib_modules_only():
    """Both sides import the contract: every module of it must load where neither torch nor kiln is installed."""
    files = sorted(Path(contract.__file__).parent.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "training_manifest.py", "checkpoint_manifest.py", "entrypoint.py"}
    modules = set()
    for path in files:
        tree = ast.parse(path.read_text())
        modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree)), path
    outside = {m for m in modules if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"}
    assert outside == {"kiln_trainer.contract", "kiln_trainer.contract.entrypoint", "kiln_trainer.errors",
                       "kiln_trainer.jsonfile"}


def test_the_former_module_names_hold_the_contracts_own_objects():
    """``kiln_trainer.training_manifest`` and ``kiln_trainer.checkpoint_manifest`` moved into the contract;
    the old names give the same objects (one definition), every one the contract's module exports."""
    from kiln_trainer import checkpoint_manifest as old_checkpoint
    from kiln_trainer import training_manifest as old_training
    from kiln_trainer.contract import checkpoint_manifest, training_manifest

    for old, new in ((old_training, training_manifest), (old_checkpoint, checkpoint_manifest)):
        assert set(old.__all__) >= set(new.__all__)
        assert all(getattr(old, name) is getattr(new, name) for name in old.__all__), old.__name__
