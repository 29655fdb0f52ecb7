"""``kiln tokenize``: a TrainingManifest's shards packed into token shards, as the tokenize stage does.

For debugging a recipe's tokenizer or a corpus away from Airflow::

    kiln tokenize --recipe tiny-bpe --manifest M.json --out DIR [--set tokenizer.vocab_size=1024] \\
        [--manifest-out M2.json]

The recipe's ``[tokenizer]`` is built (a BPE is trained on the manifest's shards, deterministically)
and the shards are packed under ``DIR`` by the trainer's own packer (one part per shard, reused when
already there). stdout gets the packed tokens' summary (token manifest, sha256s, samples, tokens);
``--manifest-out`` writes the TrainingManifest naming them, which ``kiln train --manifest`` then
trains on without packing again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kiln.cli.args import refuse_unusable_target


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("tokenize", help="pack a TrainingManifest's shards into token shards with a recipe's tokenizer")
    t.add_argument("--recipe", required=True, help="name under training/recipes (tiny, tiny-bpe) or a path")
    t.add_argument("--manifest", required=True, type=Path, help="TrainingManifest JSON")
    t.add_argument("--out", required=True, type=Path, help="folder for the packed corpora (content-addressed inside)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe field (repeatable)")
    t.add_argument("--manifest-out", type=Path, default=None,
                   help="write the TrainingManifest that names the packed tokens here")
    t.set_defaults(func=_tokenize)


def _tokenize(args: argparse.Namespace) -> int:
    from kiln.cli.train import refuse_output_inside_corpora, resolve_recipe
    from kiln.errors import ConfigError, KilnError, ManifestError
    from kiln.refs import TrainingManifest
    from kiln.stages.inputs import load_run_recipe
    from kiln_trainer.contract import TrainerError, TrainingManifestError
    from kiln_trainer.contract.training_manifest import load_training_manifest
    from kiln_trainer.data import pack_run_tokens
    from kiln_trainer.packed import load_token_manifest
    from kiln_trainer.tokenizer import load_tokenizer

    recipe_path = resolve_recipe(args.recipe)
    recipe = load_run_recipe(recipe_path, list(args.overrides))
    refuse_unusable_target("--out", args.out, directory=True)
    if args.manifest_out is not None:
        refuse_unusable_target("--manifest-out", args.manifest_out, directory=False)
        if args.manifest_out.resolve() == args.manifest.resolve():
            raise ConfigError(f"--manifest-out {args.manifest_out} is --manifest: write the new manifest elsewhere")
    refuse_output_inside_corpora("--out", args.out, args.manifest)
    if args.manifest_out is not None:
        refuse_output_inside_corpora("--manifest-out", args.manifest_out, args.manifest)
    # Everything that can fail on the inputs is read and checked here, before anything is written.
    try:
        manifest = load_training_manifest(args.manifest)  # its drop_rows are honoured by the packer
    except TrainingManifestError as exc:
        raise ConfigError(f"--manifest {exc}") from exc
    source = None
    if args.manifest_out is not None:
        try:
            source = TrainingManifest.read(args.manifest)
        except ManifestError as exc:
            raise ConfigError(f"--manifest {args.manifest}: {exc}") from exc
    eos_token = recipe.tokenizer.eos_token
    try:
        ref = pack_run_tokens(manifest, recipe, run_dir=args.out.resolve(), recipe_path=recipe_path)
        packed = load_token_manifest(ref.manifest)
        tokenizer = load_tokenizer(Path(packed.path) / packed.tokenizer_file, eos_token=eos_token)
    except TrainerError as exc:
        raise KilnError(f"{type(exc).__name__}: {exc}") from exc
    summary = {
        "token_manifest": ref.manifest, "token_manifest_sha256": ref.sha256, "tokenizer_kind": recipe.tokenizer.kind,
        "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
        "block_size": packed.block_size, "samples": packed.samples, "tokens": packed.tokens,
        "documents": packed.documents, "dropped_tokens": packed.dropped_tokens,
    }
    if source is not None and args.manifest_out is not None:
        named = source.with_tokens(ref.manifest, ref.sha256)
        named.write(args.manifest_out)
        summary["manifest"] = str(args.manifest_out.resolve())
        summary["manifest_sha256"] = named.sha256
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0
