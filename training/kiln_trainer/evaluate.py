"""Bits-per-byte of a committed checkpoint on the held-out split of a TrainingManifest.

    python -m kiln_trainer.evaluate --checkpoint RUN/checkpoints/step-00000300 \\
        [--manifest M.json] --out eval.json [--max-windows N] [--device cpu]

Without ``--manifest`` the run's own copy, ``RUN/training_manifest.json`` (written by the trainer),
is used, and only if its content hash is the one the checkpoint was trained on.

The checkpoint is verified first (``verify_checkpoint``, and its weights against the manifest's
``weights_sha256``) and scored with its own tokenizer (its ``tokenizer.json``), whatever the
tokenizer; the eval shards are hash-checked like the training shards.

Which model scores it is the checkpoint's own record (its sealed ``trainer``): kiln's GPT for a
checkpoint of kiln's trainer; for a trainer of the user's own, the ``evaluate`` entry point it
names (``[trainer] evaluate = "my_lm.evaluate:load_for_evaluation"``), called as
``load(EvalCheckpoint) -> logits function`` with the verified state, recipe and tokenizer. A user
trainer's checkpoint without one is refused, naming the trainer. Either way the model only maps
token ids to logits; the text scored, the windows and the arithmetic below are kiln's, the same for
every trainer. The scored text: the eval documents in manifest order, each encoded and followed by EOS,
as in training, after one leading EOS (so the first token is predicted from a document start),
until ``eval.max_windows x block_size`` tokens are predicted; the last document is cut at a text
(character) boundary so that its tokens fit. The token stream is cut into windows of
``block_size + 1`` tokens overlapping by one (every token is predicted once), evaluated in float32,
so the report is deterministic.

    bits_per_byte = total NLL in bits / UTF-8 bytes of the text scored

A mixture (a format-2 manifest of several sources) is scored source by source: each source's
held-out shards are a stream of their own, with the whole window budget, and the report's figures
are the sources' ``bits_per_byte`` and ``loss`` averaged with the declared weights (``tokens``,
``bytes`` and ``windows`` summed), next to each source's own under ``sources``. One stream of every
source in turn would score only the first once its text fills the budget. A source without held-out
shards is listed with ``bits_per_byte: null`` and weighs nothing.

EOS predictions count in the NLL and add no bytes (a document boundary is information every
tokenizer has to predict once per document), so the figure compares across tokenizers; ``loss`` is
the mean NLL per predicted token (nats).

Report (``kind == "kiln.EvalReport"``)::

    {"kind": "kiln.EvalReport", "checkpoint": "/abs/step-dir", "weights_sha256": "<hex>",
     "split": "eval", "bits_per_byte": 2.31, "loss": 1.60, "tokens": 8192, "bytes": 8133,
     "windows": 64, "step": 300, "checkpoint_manifest_sha256": "<hex>",
     "training_manifest_sha256": "<hex>", "snapshot_id": "<md5>.dir",
     "tokenizer_sha256": "<hex>", "token_manifest_sha256": "<hex>", "trainer": "kiln",
     "sources": [{"name": "code", "weight": 0.7, "bits_per_byte": 2.1, "loss": 1.4, "tokens": 8192,
                  "bytes": 9001, "windows": 64}, ...]}         # a mixture's only
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln_trainer.checkpoint import load_model_weights, weights_sha256
from kiln_trainer.checkpoint_manifest import (
    CURRENT_FORMATS,
    TOKENIZER_FILE,
    TRAINING_MANIFEST_COPY,
    atomic_write_bytes,
    manifest_sha256,
)
from kiln_trainer.config import Recipe
from kiln_trainer.contract.checkpoint_manifest import TRAINER_KEY
from kiln_trainer.contract.entrypoint import KILN_TRAINER, load_entrypoint
from kiln_trainer.errors import CheckpointError, ShardIntegrityError, TrainerError, TrainingManifestError
from kiln_trainer.model import GPT
from kiln_trainer.packed import iter_training_texts
from kiln_trainer.tokenizer import Tokenizer, load_tokenizer
from kiln_trainer.training_manifest import load_training_manifest

log = logging.getLogger("kiln_trainer.evaluate")

EVAL_KIND = "kiln.EvalReport"


Logits = Callable[[torch.Tensor], torch.Tensor]
"""What a model is to evaluation: token ids ``(batch, T)`` (long, on the device) to logits
``(batch, T, vocab)``, where ``vocab`` covers the tokenizer's ids. Called under ``torch.no_grad``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalCheckpoint:
    """What kiln hands a trainer's ``evaluate`` entry point: a committed checkpoint, verified."""

    step_dir: Path
    manifest: dict[str, Any]
    """The sealed manifest, every file of the checkpoint checked against it."""
    recipe: Recipe
    """The resolved recipe the weights were trained under (the manifest's)."""
    state: dict[str, torch.Tensor]
    """The whole model state dict (a sharded checkpoint's shards consolidated, any world size), on the
    CPU; it hashes to the manifest's ``weights_sha256``. Load it strictly."""
    tokenizer: Tokenizer
    """The tokenizer the weights were trained with (hash-checked)."""
    device: str
    """Where the returned function gets its token ids (``cpu`` unless ``--device`` says otherwise)."""


def trainer_spec(manifest: dict[str, Any]) -> str:
    """The trainer that made a checkpoint, from its sealed record: ``kiln`` or the train entry point
    (a checkpoint sealed before the record existed is kiln's)."""
    record = manifest.get(TRAINER_KEY) or {}
    return str(record.get("spec") or KILN_TRAINER)


def _verified_state(step_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(verified manifest, whole model state) of a checkpoint of a format evaluation reads."""
    manifest, state = load_model_weights(step_dir)
    if manifest.get("format") not in CURRENT_FORMATS:
        raise CheckpointError(
            f"{step_dir}: checkpoint format {manifest.get('format')} predates the token data path (no tokenizer "
            f"in it); this kiln reads formats {CURRENT_FORMATS}"
        )
    if weights_sha256(state) != manifest["weights_sha256"]:
        raise CheckpointError(f"{step_dir}: the model state does not hash to the manifest's weights_sha256")
    return manifest, state


def _kiln_gpt(manifest: dict[str, Any], state: dict[str, torch.Tensor], device: str) -> GPT:
    model = GPT(Recipe.from_dict(manifest["recipe"]).model)
    model.load_state_dict(state)
    model.to(device).eval()
    return model


def load_checkpoint_model(step_dir: str | Path, device: str = "cpu") -> tuple[GPT, dict[str, Any]]:
    """kiln's GPT of a verified checkpoint of kiln's trainer (eval mode) and its manifest;
    ``TrainerError`` for a checkpoint another trainer made (``load_checkpoint_logits`` loads either)."""
    step_dir = Path(step_dir)
    manifest, state = _verified_state(step_dir)
    made_by = trainer_spec(manifest)
    if made_by != KILN_TRAINER:
        raise TrainerError(f"{step_dir}: made by trainer {made_by!r}, not by kiln's: its weights are not kiln's GPT")
    return _kiln_gpt(manifest, state, device), manifest


def load_checkpoint_logits(step_dir: str | Path, device: str = "cpu") -> tuple[Logits, EvalCheckpoint]:
    """The model of a verified checkpoint as a logits function, and the checkpoint: kiln's GPT for
    kiln's trainer, else what the trainer's ``evaluate`` entry point (named in the checkpoint's sealed
    record) makes of the verified checkpoint. ``TrainerError`` naming the trainer when it names none,
    or when its entry point does not load or returns no function."""
    step_dir = Path(step_dir).resolve()
    manifest, state = _verified_state(step_dir)
    checkpoint = EvalCheckpoint(step_dir=step_dir, manifest=manifest, recipe=Recipe.from_dict(manifest["recipe"]),
                                state=state, tokenizer=load_checkpoint_tokenizer(step_dir, manifest), device=device)
    made_by = trainer_spec(manifest)
    if made_by == KILN_TRAINER:
        model = _kiln_gpt(manifest, state, device)
        return (lambda ids: model(ids)[0]), checkpoint
    loader = str((manifest.get(TRAINER_KEY) or {}).get("evaluate") or "")
    if not loader:
        raise TrainerError(
            f"{step_dir}: made by trainer {made_by!r}, whose recipe names no evaluate entry point; kiln loads only "
            "its own GPT, so name the function that loads this trainer's checkpoints "
            "([trainer] evaluate = 'package.module:function', docs/trainer-contract.md)"
        )
    load = load_entrypoint(loader, "trainer.evaluate")
    try:
        logits = load(checkpoint)
    except TrainerError:
        raise
    except Exception as exc:  # the user's loader failed: name it and what it raised
        raise TrainerError(f"{step_dir}: trainer.evaluate = {loader!r} failed to load the checkpoint: "
                           f"{type(exc).__name__}: {exc}") from exc
    if not callable(logits):
        raise TrainerError(f"{step_dir}: trainer.evaluate = {loader!r} returned a {type(logits).__name__}, "
                           "not a function from token ids to logits")
    return logits, checkpoint


def load_checkpoint_tokenizer(step_dir: str | Path, manifest: dict[str, Any]) -> Tokenizer:
    """The tokenizer a verified checkpoint was trained with (its ``tokenizer.json``)."""
    recipe = Recipe.from_dict(manifest["recipe"])
    tokenizer = load_tokenizer(Path(step_dir) / TOKENIZER_FILE, eos_token=recipe.tokenizer.eos_token)
    if tokenizer.sha256 != manifest["tokenizer_sha256"]:
        raise CheckpointError(f"{step_dir}: {TOKENIZER_FILE} does not hash to the manifest's tokenizer_sha256")
    return tokenizer


@dataclass(frozen=True, slots=True)
class ScoredText:
    """The eval token stream and the UTF-8 bytes of the text it encodes."""

    ids: list[int]
    """Leading EOS, then each document's ids and its EOS (the last document maybe cut, without EOS)."""
    text_bytes: int


def scored_text(texts: Iterable[str], tokenizer: Tokenizer, max_tokens: int) -> ScoredText:
    """Documents in order until ``max_tokens`` tokens are predicted (``len(ids) - 1 <= max_tokens``);
    the document that would pass the budget is cut at the longest character prefix that fits."""
    ids, text_bytes = [tokenizer.eos_id], 0
    for text in texts:
        room = max_tokens - (len(ids) - 1)
        if room <= 0:
            break
        doc = tokenizer.encode_batch([text])[0]
        if len(doc) + 1 <= room:
            ids += [*doc, tokenizer.eos_id]
            text_bytes += len(text.encode("utf-8"))
            continue
        cut = _longest_prefix_within(text, tokenizer, room)
        if cut:
            ids += tokenizer.encode_batch([text[:cut]])[0]
            text_bytes += len(text[:cut].encode("utf-8"))
        break
    return ScoredText(ids=ids, text_bytes=text_bytes)


def _longest_prefix_within(text: str, tokenizer: Tokenizer, room: int) -> int:
    """The most characters of ``text`` whose encoding has at most ``room`` tokens (binary search)."""
    low, high = 0, min(len(text), room * 64)  # no tokenizer here packs more than 64 characters into a token
    while low < high:
        mid = (low + high + 1) // 2
        if len(tokenizer.encode_batch([text[:mid]])[0]) <= room:
            low = mid
        else:
            high = mid - 1
    return low


def run_training_manifest(step_dir: str | Path, ck_manifest: dict[str, Any]) -> Path:
    """The TrainingManifest copy in the checkpoint's run dir, checked against the checkpoint."""
    path = Path(step_dir).resolve().parent.parent / TRAINING_MANIFEST_COPY
    if not path.is_file():
        raise TrainingManifestError(f"no --manifest given and {path} does not exist; pass the TrainingManifest explicitly")
    found = load_training_manifest(path).sha256
    if found != ck_manifest["training_manifest_sha256"]:
        raise TrainingManifestError(
            f"{path} has content hash {found}, but {step_dir} was trained on "
            f"{ck_manifest['training_manifest_sha256']}; pass the right --manifest"
        )
    return path


@torch.no_grad()
def evaluate_checkpoint(
    step_dir: str | Path,
    manifest_path: str | Path | None = None,
    *,
    max_windows: int | None = None,
    batch_size: int | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Compute the EvalReport dict for one committed checkpoint (see module docstring)."""
    step_dir = Path(step_dir).resolve()
    model, checkpoint = load_checkpoint_logits(step_dir, device)
    ck_manifest, tokenizer, recipe = checkpoint.manifest, checkpoint.tokenizer, checkpoint.recipe
    made_by = trainer_spec(ck_manifest)
    if manifest_path is None:
        manifest_path = run_training_manifest(step_dir, ck_manifest)
    training_manifest = load_training_manifest(manifest_path)
    if not training_manifest.eval_shards:
        raise TrainingManifestError(f"{manifest_path}: no eval_shards to evaluate on")
    block = recipe.model.block_size
    windows_asked = max_windows or recipe.eval.max_windows
    batch = batch_size or recipe.eval.batch_size

    def score(eval_shards: Any, where: str) -> _Score:
        text = scored_text(iter_training_texts(eval_shards), tokenizer, windows_asked * block)
        if len(text.ids) < 2 or text.text_bytes == 0:
            raise ShardIntegrityError(f"{manifest_path}: the eval shards{where} hold no text to score")
        return _score_stream(model, text, block, batch, device, step_dir, made_by, tokenizer.vocab_size)

    sources = training_manifest.data_sources
    per_source: list[dict[str, Any]] = []
    if training_manifest.is_mixture:
        # Each source is scored on its own held-out split with the whole window budget (one stream
        # would score the first source only, once its text fills the budget); the run's figure is
        # their mean weighted by the declared weights, the distribution the mixture trains toward.
        # A source without held-out shards is listed, unscored, and weighs nothing.
        scored: list[tuple[float, _Score]] = []
        for source in sources:
            entry: dict[str, Any] = {"name": source.name, "weight": source.weight}
            if source.eval_shards:
                result = score(source.eval_shards, f" of source {source.name!r}")
                scored.append((source.weight, result))
                entry.update(result.fields())
            else:
                entry.update(bits_per_byte=None, loss=None, tokens=0, bytes=0, windows=0)
            per_source.append(entry)
        total_weight = sum(w for w, _ in scored)
        bits_per_byte = sum(w * r.bits_per_byte for w, r in scored) / total_weight
        loss = sum(w * r.loss for w, r in scored) / total_weight
        tokens, text_bytes, windows = (sum(getattr(r, k) for _, r in scored) for k in ("tokens", "bytes", "windows"))
    else:
        whole = score(training_manifest.eval_shards, "")
        bits_per_byte, loss, tokens, text_bytes, windows = (whole.bits_per_byte, whole.loss, whole.tokens, whole.bytes,
                                                            whole.windows)
    report: dict[str, Any] = {
        "kind": EVAL_KIND,
        "checkpoint": str(step_dir),
        "weights_sha256": ck_manifest["weights_sha256"],
        "split": "eval",
        "bits_per_byte": bits_per_byte,
        "loss": loss,
        "tokens": tokens,
        "bytes": text_bytes,
        "windows": windows,
        "step": ck_manifest["step"],
        "checkpoint_manifest_sha256": manifest_sha256(step_dir),
        "training_manifest_sha256": training_manifest.sha256,
        "snapshot_id": training_manifest.snapshot_id,
        "tokenizer_sha256": tokenizer.sha256,
        "token_manifest_sha256": ck_manifest["token_manifest_sha256"],
        "trainer": made_by,
    }
    if per_source:
        report["sources"] = per_source
    return report


@dataclass(frozen=True, slots=True)
class _Score:
    """One token stream's score."""

    bits_per_byte: float
    loss: float
    tokens: int
    bytes: int
    windows: int

    def fields(self) -> dict[str, Any]:
        return {"bits_per_byte": self.bits_per_byte, "loss": self.loss, "tokens": self.tokens, "bytes": self.bytes,
                "windows": self.windows}


def _score_stream(model: Callable[[torch.Tensor], Any], text: ScoredText, block: int, batch: int, device: str,
                  step_dir: Path, made_by: str, vocab_size: int) -> _Score:
    """NLL of every token of ``text`` after the first, in windows of ``block + 1`` overlapping by one."""
    stream = torch.tensor(text.ids, dtype=torch.long)
    starts = list(range(0, len(stream) - 1, block))
    total_nats, total_tokens = 0.0, 0
    for i in range(0, len(starts), batch):
        for length, group in _same_length(stream, starts[i : i + batch], block):
            chunk = torch.stack([stream[a : a + length] for a in group]).to(device)
            inputs, targets = chunk[:, :-1], chunk[:, 1:]
            logits = model(inputs)
            if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == inputs.shape
                    and logits.size(-1) >= vocab_size):
                got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                raise TrainerError(f"{step_dir}: the model of trainer {made_by!r} gave {got} for token ids of shape "
                                   f"{tuple(inputs.shape)}; expected logits (batch, T, vocab >= {vocab_size})")
            nats = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
            total_nats += float(nats.item())
            total_tokens += targets.numel()
    loss = total_nats / total_tokens
    if not math.isfinite(loss):
        raise TrainerError(f"{step_dir}: evaluation loss is not finite ({loss})")
    return _Score(bits_per_byte=total_nats / math.log(2) / text.text_bytes, loss=loss, tokens=total_tokens,
                  bytes=text.text_bytes, windows=len(starts))
def _same_length(stream: torch.Tensor, starts: list[int], block: int) -> list[tuple[int, list[int]]]:
    """Window starts grouped by window length (all ``block + 1`` but the stream's last, shorter one)."""
    groups: dict[int, list[int]] = {}
    for a in starts:
        groups.setdefault(min(block + 1, len(stream) - a), []).append(a)
    return sorted(groups.items(), reverse=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m kiln_trainer.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="a committed step directory")
    parser.add_argument(
        "--manifest", type=Path, default=None, help="TrainingManifest JSON (uses eval_shards); default: the run's copy"
    )
    parser.add_argument("--out", required=True, type=Path, help="where to write the EvalReport JSON")
    parser.add_argument("--max-windows", type=int, default=None, help="override eval.max_windows of the recipe")
    parser.add_argument("--device", default="cpu", help="cpu (default, deterministic) or cuda")
    args = parser.parse_args(argv)
    try:
        report = evaluate_checkpoint(args.checkpoint, args.manifest, max_windows=args.max_windows, device=args.device)
    except TrainerError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    atomic_write_bytes(args.out, (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
    log.info(
        "bits/byte %.4f (loss %.4f over %d tokens, %d bytes) -> %s",
        report["bits_per_byte"],
        report["loss"],
        report["tokens"],
        report["bytes"],
        args.out,
    )
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
