"""Shared helpers of the provenance tests: a small artifact directory and the inputs of its statement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.provenance.statement import ProvenanceInputs, TrainerIdentity

H = "ab" * 32


def make_artifact(root: Path, salt: str = "") -> Path:
    """A model directory shaped like a registered version's (small files, nested folders)."""
    (root / "artifacts" / "hf_model").mkdir(parents=True)
    (root / "code" / "kiln_trainer").mkdir(parents=True)
    (root / "MLmodel").write_text(f"flavors: {{}}\n# {salt}\n")
    (root / "artifacts" / "hf_model" / "model.safetensors").write_bytes(bytes(range(256)) * 8 + salt.encode())
    (root / "artifacts" / "hf_model" / "config.json").write_text('{"model_type": "gpt2"}')
    (root / "artifacts" / "recipe.json").write_text('{"train": {"seed": 1337, "steps": 12}}')
    (root / "code" / "kiln_trainer" / "serving.py").write_text("def serve():\n    return 1\n")
    return root


def inputs(**changes: Any) -> ProvenanceInputs:
    fields: dict[str, Any] = {
        "policy": "production", "dag_id": "kiln_production", "run_id": "manual__2026-01-01", "launcher": "local",
        "nodes": ("node-a", "node-b"), "recipe": {"train": {"seed": 1337, "steps": 12}, "parallel": {"strategy": "ddp"}},
        "seed": 1337, "world_size": 2, "strategy": "ddp", "steps": 12, "snapshot_id": "0123456789abcdef0123456789abcdef.dir",
        "corpus": "stdlib-py", "snapshot_remote": "/srv/dvc-remote", "contract": "stdlib-py@1", "contract_suite_sha256": H,
        "quarantine_report_sha256": H, "quarantine_report_uri": "/runs/r/quarantine.json", "training_manifest_sha256": H,
        "training_manifest_uri": "/runs/r/training_manifest.json", "tokenizer_kind": "byte", "tokenizer_sha256": H,
        "token_manifest_sha256": H, "token_manifest_uri": "/runs/r/tokens/token_manifest.json", "git_commit": "f" * 40,
        "code_sha256": H, "trainer": TrainerIdentity(spec="kiln", distribution="kiln", version="0.1.0", sha256=H),
        "torch_version": "2.13.0", "python_version": "3.11.9", "platform": "linux-x86_64",
        "started_on": "2026-01-01T00:00:00Z", "finished_on": "2026-01-01T00:05:00Z", "checkpoint_manifest_sha256": H,
        "eval_report": {"bits_per_byte": 2.5, "split": "eval"}, "decision": {"action": "promote", "reasons": ["first model"]},
        "kiln_version": "0.1.0",
    }
    fields.update(changes)
    if "run_key" not in changes:  # the run key is the DAG and run the inputs name
        fields["run_key"] = f"{fields['dag_id']}/{fields['run_id']}"
    return ProvenanceInputs(**fields)
