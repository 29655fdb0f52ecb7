"""``kiln train`` and ``kiln evaluate``: the trainer from the command line, on this machine.

``kiln train`` runs the job through the local launcher (``kiln.launchers.launch_local``): N torchrun
agents on this host form one N-node gang over c10d rendezvous, exactly as the train stage does::

    kiln train --recipe tiny --manifest M.json --run-dir RUN [--nnodes N] [--nproc-per-node P] \\
        [--set section.key=value ...] [--trainer SPEC] [--max-restarts R] [--max-steps S]

``--recipe`` is a name under ``training/recipes`` (``tiny``, ``tiny.toml``, ``production/small``)
or a path to a TOML file. The recipe names its trainer (``trainer``: ``kiln``, the default, or
``package.module:function`` of your own package); ``--trainer SPEC`` is ``--set trainer.train=SPEC``.
A recipe or a trainer that does not resolve is refused before any agent starts (exit 2, naming it).
Trainer output goes to stderr; stdout gets the TrainResult JSON. Re-running
the same line resumes from the newest committed checkpoint in RUN.

``kiln evaluate`` scores one committed checkpoint on the held-out split and writes an EvalReport::

    kiln evaluate --checkpoint RUN/checkpoints/step-00000400 --report eval.json [--manifest M.json]

Without ``--manifest`` it uses the run's own copy of the TrainingManifest (RUN/training_manifest.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from kiln.cli.args import non_negative_int, positive_int, refuse_unusable_target


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train a recipe on a TrainingManifest (torchrun, local launcher)")
    t.add_argument("--recipe", required=True, help="name under training/recipes (tiny, production/small) or a path")
    t.add_argument("--manifest", required=True, type=Path, help="TrainingManifest JSON")
    t.add_argument("--run-dir", required=True, type=Path, help="run directory (checkpoints, metrics, result.json)")
    t.add_argument("--nnodes", type=positive_int, default=1, help="torchrun agents (each plays one node; default 1)")
    t.add_argument("--nproc-per-node", type=positive_int, default=1, help="ranks per agent (default 1)")
    t.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a recipe field (repeatable)",
    )
    t.add_argument("--trainer", default=None, metavar="SPEC",
                   help="the train entry point: kiln (kiln's trainer) or package.module:function of your own "
                        "package (default: the recipe's trainer)")
    t.add_argument("--max-restarts", type=non_negative_int, default=0,
                   help="torchrun whole-gang restarts on failure (default 0)")
    t.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after this step (checkpointed; re-run resumes)")
    t.set_defaults(func=_train)

    e = sub.add_parser("evaluate", help="bits-per-byte of a committed checkpoint on the eval split")
    e.add_argument("--checkpoint", required=True, type=Path, help="committed step dir, RUN/checkpoints/step-NNNNNNNN")
    e.add_argument("--report", required=True, type=Path, help="where to write the EvalReport JSON")
    e.add_argument(
        "--manifest", type=Path, default=None,
        help="TrainingManifest JSON (default: the run's copy, RUN/training_manifest.json)",
    )
    e.add_argument("--max-windows", type=positive_int, default=None,
                   help="override the recipe's eval.max_windows (an integer >= 1)")
    e.set_defaults(func=_evaluate)


def resolve_recipe(name: str) -> Path:
    """``tiny`` / ``tiny.toml`` / ``production/small.toml`` under training/recipes, or an existing path."""
    from kiln.errors import ConfigError
    from kiln.policy import RECIPES_DIR

    given = Path(name)
    if given.suffix == ".toml" and given.is_file():
        return given.resolve()
    for candidate in (RECIPES_DIR / name, RECIPES_DIR / f"{name}.toml"):
        if candidate.suffix == ".toml" and candidate.is_file():
            return candidate.resolve()
    known = sorted(str(p.relative_to(RECIPES_DIR).with_suffix("")) for p in RECIPES_DIR.rglob("*.toml"))
    raise ConfigError(f"unknown recipe {name!r}: not a TOML file and not under {RECIPES_DIR}; known: {known}")


def _run_key(run_dir: Path) -> str:
    """Stable per run dir, so a re-run of the same line rejoins the same rendezvous id."""
    digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    return f"kiln-train-{run_dir.name}-{digest}"


def _train(args: argparse.Namespace) -> int:
    from kiln.errors import ConfigError, ManifestError
    from kiln.launchers import LaunchSpec, launch_local
    from kiln.launchers.base import check_manifest, check_recipe

    recipe = resolve_recipe(args.recipe)
    manifest = args.manifest.resolve()
    if not manifest.is_file():
        raise ConfigError(f"--manifest {args.manifest}: no such file")
    run_dir = args.run_dir.resolve()
    refuse_unusable_target("--run-dir", run_dir, directory=True)
    refuse_output_inside_corpora("--run-dir", run_dir, manifest)
    spec = LaunchSpec(
        run_dir=run_dir,
        manifest=manifest,
        recipe=recipe,
        run_key=_run_key(run_dir),
        nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        max_restarts=args.max_restarts,
        overrides=(*args.overrides, *([f"trainer.train={json.dumps(args.trainer)}"] if args.trainer else [])),
        max_steps=args.max_steps,
    )
    check_recipe(spec)  # the recipe and its trainer, before any agent (the launcher checks again)
    try:
        check_manifest(spec)  # the launcher checks it too; on the command line it is a usage error
    except ManifestError as exc:
        raise ConfigError(f"--manifest {exc}") from exc
    # stdout carries only the result JSON; the agents' logs go to stderr.
    result = launch_local(spec, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    return 0


def refuse_report_inside_inputs(report: Path, checkpoint: Path, manifest: Path | None) -> None:
    """``ConfigError`` (exit 2) when the report would land where it changes what it reports on: inside
    the run's checkpoint tree (a file in a committed step un-commits it, and resume falls back to
    the step before), on the TrainingManifest it reads, or inside the corpus of its eval shards."""
    from kiln.errors import ConfigError
    from kiln.util.fs import lies_inside
    from kiln_trainer.contract import CHECKPOINTS_SUBDIR, MANIFEST_NAME, TRAINING_MANIFEST_COPY

    step = checkpoint.resolve()
    tree = step.parent if step.parent.name == CHECKPOINTS_SUBDIR else step  # RUN/checkpoints/step-N
    is_checkpoint = tree != step or (step / MANIFEST_NAME).exists()  # else the evaluation says it is none
    if is_checkpoint and lies_inside(report, tree):
        raise ConfigError(f"--report {report} lies inside the checkpoint tree {tree}: a file written there "
                          "would un-commit a checkpoint; write the report elsewhere")
    manifests = [manifest] if manifest is not None else [step.parent.parent / TRAINING_MANIFEST_COPY]
    for path in manifests:
        if os.path.realpath(report) == os.path.realpath(path):
            raise ConfigError(f"--report {report} is the TrainingManifest {path} the evaluation reads")
    refuse_output_inside_corpora("--report", report, manifests[0])


def refuse_output_inside_corpora(flag: str, output: Path, manifest: Path) -> None:
    """``ConfigError`` (exit 2) when ``output`` lies inside a corpus whose shards the TrainingManifest
    ``manifest`` names: a file written there changes the corpus (its snapshot, its ``--replace``
    check) that the command reads."""
    from kiln.errors import ConfigError
    from kiln.util.fs import lies_inside

    for corpus in _manifest_corpora(manifest):
        if lies_inside(output, corpus):
            raise ConfigError(f"{flag} {output} lies inside the corpus {corpus} the manifest's shards come from: "
                              "writing it there would change the corpus")


def _manifest_corpora(manifest: Path) -> list[Path]:
    """The folders of a TrainingManifest's shards (``CORPUS/eval/x.parquet`` -> ``CORPUS``, a shard
    elsewhere -> its folder); none when it cannot be read (the evaluation then says why)."""
    from kiln_trainer.contract import TrainerError
    from kiln_trainer.contract.training_manifest import load_training_manifest

    try:
        loaded = load_training_manifest(manifest)
    except (TrainerError, OSError, ValueError):  # the evaluation then reports it, with its own message
        return []
    folders = {Path(entry.path).parent for entry in (*loaded.shards, *loaded.eval_shards)}
    return sorted(f.parent if f.name in ("train", "eval") else f for f in folders)


def _evaluate(args: argparse.Namespace) -> int:
    from kiln.errors import KilnError
    from kiln_trainer.contract import TrainerError, atomic_write_bytes
    from kiln_trainer.evaluate import evaluate_checkpoint

    refuse_unusable_target("--report", args.report, directory=False)  # before the evaluation, not after it
    refuse_report_inside_inputs(args.report, args.checkpoint, args.manifest)
    try:
        report = evaluate_checkpoint(args.checkpoint, args.manifest, max_windows=args.max_windows)
    except TrainerError as exc:
        raise KilnError(f"{type(exc).__name__}: {exc}") from exc
    atomic_write_bytes(args.report, (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0
