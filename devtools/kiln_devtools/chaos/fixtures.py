"""Small real inputs the chaos families share: a corpus, its TrainingManifest, a trainer run."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kiln.refs import TrainingManifest
from kiln.shipped import RECIPES_DIR

TINY_RECIPE = RECIPES_DIR / "tiny.toml"
SNAPSHOT_ID = "c4a05c4a05c4a05c4a05c4a05c4a05c4.dir"
"""A stand-in snapshot id for manifests built outside a DVC workspace."""


def pinned_recipe(manifest: Path) -> Path:
    """The ``tiny`` recipe as it was when this manifest's runs began, copied next to the manifest:
    a recipe edited in the checkout during a long suite would make a resume refuse (recipe hash)."""
    pinned = Path(manifest).parent / TINY_RECIPE.name
    if not pinned.exists():
        shutil.copyfile(TINY_RECIPE, pinned)
    return pinned


def shard_entry(path: Path) -> dict:
    import pyarrow.parquet as pq

    return {"path": str(path.resolve()), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "rows": int(pq.ParquetFile(path).metadata.num_rows)}


def clean_manifest(root: Path, *, shards: int = 2, max_bytes: int = 300_000) -> Path:
    """A clean stdlib corpus (``kiln.data.corpus``) under ``root`` and a manifest of all its shards."""
    from kiln.data.corpus import build_corpus

    built = build_corpus(root / "corpus", shards=shards, seed=0, max_bytes=max_bytes)
    manifest = TrainingManifest.build(
        snapshot_id=SNAPSHOT_ID, corpus="stdlib-py", contract="stdlib-py@1",
        shards=[shard_entry(Path(p)) for p in built["train"]],
        eval_shards=[shard_entry(Path(p)) for p in built["eval"]],
    )
    return manifest.write(root / "manifest.json")


def run_trainer(manifest: Path, run_dir: Path, overrides: list[str], *, max_steps: int | None = None,
                timeout_s: float = 600.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One single-process trainer run (``python -m kiln_trainer.train``): exit status and output."""
    argv = [sys.executable, "-m", "kiln_trainer.train", "--manifest", str(manifest),
            "--recipe", str(pinned_recipe(manifest)), "--run-dir", str(run_dir)]
    for item in overrides:
        argv += ["--set", item]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                          env={**os.environ, "KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
                               "MLFLOW_TRACKING_URI": "", **(env or {})})
