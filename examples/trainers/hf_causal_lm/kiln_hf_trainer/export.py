"""A committed checkpoint of this trainer as a Hugging Face model folder::

    python -m kiln_hf_trainer.export --checkpoint RUN/checkpoints/step-00000400 --out out/

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out/")        # the trained LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained("out/")           # the ids it trained on

The folder holds what ``save_pretrained`` writes (``config.json``, ``model.safetensors``: transformers
5 writes safetensors only, no pickle; ``generation_config.json``) and the checkpoint's own tokenizer
in its Hugging Face form (``tokenizer.json``, ``tokenizer_config.json``: ``kiln_trainer.hf``'s, the
same files kiln's own export writes). The checkpoint is verified first (every file's sha256, the
weights' hash), whichever strategy and world size wrote it; its weights load into the model strictly.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from transformers import GenerationConfig

from kiln_hf_trainer.model import trained_model
from kiln_trainer.checkpoint import load_model_weights, weights_sha256
from kiln_trainer.checkpoint_manifest import atomic_write_bytes
from kiln_trainer.config import Recipe
from kiln_trainer.contract import EXIT_FATAL, EXIT_OK
from kiln_trainer.errors import CheckpointError, TrainerError
from kiln_trainer.export import checkpoint_tokenizer
from kiln_trainer.hf import generation_config, tokenizer_files

log = logging.getLogger("kiln_hf_trainer.export")

TRAINER_PACKAGE = __name__.split(".")[0]


def export_folder(step_dir: str | Path, out_dir: str | Path) -> Path:
    """Verify the committed checkpoint ``step_dir`` of this trainer and write its Hugging Face folder
    into ``out_dir`` (created; its files replaced). ``TrainerError`` for a checkpoint that fails
    verification, or that another trainer made."""
    step_dir = Path(step_dir)
    manifest, state = load_model_weights(step_dir)  # every file's sha256 checked; shards consolidated
    if weights_sha256(state) != manifest["weights_sha256"]:
        raise CheckpointError(f"{step_dir}: the model state does not hash to the manifest's weights_sha256")
    spec = (manifest.get("trainer") or {}).get("spec", "")
    if not spec.startswith(f"{TRAINER_PACKAGE}."):
        raise TrainerError(f"{step_dir}: made by trainer {spec or 'kiln'!r}, not by {TRAINER_PACKAGE}")
    recipe = Recipe.from_dict(manifest["recipe"])
    tokenizer = checkpoint_tokenizer(step_dir, manifest)
    model = trained_model(recipe, tokenizer, state, use_cache=True)
    model.generation_config = GenerationConfig(**generation_config(tokenizer))
    out = Path(out_dir)
    model.save_pretrained(out)
    for name, data in tokenizer_files(tokenizer, recipe.model.block_size).items():
        atomic_write_bytes(out / name, data)
    return out


def main(argv: list[str] | None = None) -> int:
    """``--checkpoint STEP_DIR --out DIR``; 0, or 2 with the reason logged."""
    parser = argparse.ArgumentParser(prog="python -m kiln_hf_trainer.export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="committed step dir, RUN/checkpoints/step-N")
    parser.add_argument("--out", required=True, type=Path, help="the folder to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        out = export_folder(args.checkpoint, args.out)
    except TrainerError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return EXIT_FATAL
    print(out)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
