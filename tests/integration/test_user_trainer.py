"""A trainer of the user's own, named by the recipe, trains under torchrun through the local launcher.

The user's package lives outside kiln's source tree (under tmp_path, "installed" with the
``.dist-info`` pip writes) and reaches the agents on ``PYTHONPATH``. Its entry point announces itself
and delegates to kiln's loop, so the run is a real one: kiln's worker calls it on every rank, and the
committed checkpoint records which trainer, and which version of its distribution, made the weights.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from kiln.launchers import LaunchSpec, launch_local
from kiln_trainer.contract.checkpoint_manifest import verify_checkpoint
from kiln_trainer.contract.entrypoint import _packages_distributions

from training_manifests import stdlib_manifest

pytestmark = pytest.mark.slow

TINY = Path(__file__).resolve().parents[2] / "training" / "recipes" / "tiny.toml"

TRAIN = '''
    """tinytrainer: announces itself on every rank, then runs kiln's loop."""
    import os
    import sys

    from kiln_trainer.train import main as kiln_main

    def main(argv: list[str]) -> int:
        print(f"tinytrainer 0.3.0 rank {os.environ.get('RANK')}: {len(argv)} arguments", file=sys.stderr, flush=True)
        return kiln_main(argv)
'''


def _install(site: Path) -> None:
    package = site / "tinytrainer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(textwrap.dedent(TRAIN))
    info = site / "tinytrainer-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinytrainer\nVersion: 0.3.0\n")
    (info / "top_level.txt").write_text("tinytrainer\n")
    (info / "RECORD").write_text("tinytrainer/__init__.py,,\ntinytrainer/train.py,,\n")


def test_a_recipe_names_a_user_trainer_that_trains_under_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site = tmp_path / "site"
    _install(site)
    monkeypatch.syspath_prepend(str(site))  # the launcher validates the entry point in this process
    _packages_distributions.cache_clear()
    recipe = tmp_path / "user.toml"
    tiny = TINY.read_text()
    kiln_sections = tiny[tiny.index("[tokenizer]"):]
    # The [model] table is the user's: kiln reads block_size; `note` is the user's own key.
    recipe.write_text('trainer = "tinytrainer.train:main"\n\n[model]\nblock_size = 64\nnote = "mine"\n\n'
                      + kiln_sections)
    manifest = stdlib_manifest(tmp_path, 40_000)
    run_dir = tmp_path / "run"
    spec = LaunchSpec(
        run_dir=run_dir, manifest=manifest, recipe=recipe, run_key=f"user-trainer-{tmp_path.name}",
        nodes=1, nproc_per_node=2,
        overrides=("train.steps=4", "checkpoint.every_steps=4", "optim.warmup_steps=1", "train.log_every=2"),
        env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)},
    )
    lines: list[str] = []
    try:
        result = launch_local(spec, log=lines.append)
    finally:
        _packages_distributions.cache_clear()
    log = "\n".join(lines)
    assert result.completed and result.step == 4 and result.world_size == 2, log[-3000:]
    for rank in (0, 1):
        assert f"tinytrainer 0.3.0 rank {rank}: " in log  # kiln's worker called the user's entry point
    committed = verify_checkpoint(result.checkpoint)
    assert committed["trainer"] == {"spec": "tinytrainer.train:main", "distribution": "tinytrainer",
                                    "version": "0.3.0"}
    assert committed["recipe"]["trainer"] == "tinytrainer.train:main"
    assert committed["recipe"]["model"] == {"block_size": 64, "vocab_size": 257, "note": "mine"}
    assert json.loads((run_dir / "result.json").read_text())["checkpoint"] == result.checkpoint
