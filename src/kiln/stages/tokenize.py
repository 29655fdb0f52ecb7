"""The tokenize stage: the data gate's healthy shards as packed token shards the trainer streams.

    data_gate ─► tokenizer ─► tokenize (mapped over batches of shards) ─► tokens ─► train

* ``tokenizer_stage``: the tokenizer the run's recipe asks for (``[tokenizer]``: byte, a BPE trained
  on the run's healthy training shards, or a file), as an artifact in ``KILN_HOME/tokenizers/``
  named by its sha256. Training it twice on the same shards gives the same bytes, so a retry, or
  another run of the same snapshot and recipe, finds it there.
* ``tokenize_stage``: one batch of shards packed (part ``i`` is shard ``i`` of the manifest, as the
  trainer packs them: the content address names the same bytes whoever packs), idempotent.
* ``tokens_stage``: the parts joined into ``token_manifest.json`` (written last), optionally
  published to S3 (``KILN_TOKENS_REMOTE``), and the run's training manifest rewritten to name it:
  the manifest the trainer, evaluation and registration read from then on.

Packed corpora live in ``KILN_HOME/tokens/<shard set>/<token_shards_key>/``: the shard set (the
sha256 of the healthy shards' hashes) and the content address of snapshot, tokenizer, EOS and block
size. Another run of the same shards with the same recipe tokenizer reuses them; a run whose gate
kept other shards of the same snapshot gets its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from kiln import settings as kiln_settings
from kiln.errors import ConfigError, ManifestError, RunMismatchError
from kiln.policy import Policy
from kiln.refs import (
    MIXTURE_FORMAT,
    DataGateResult,
    PackedPart,
    PackedTokensRef,
    TokenizerRef,
    TrainingManifest,
    canonical_json,
)
from kiln.stages.inputs import load_run_recipe, train_inputs
from kiln.stages.records import own_training_manifest
from kiln.util.fs import atomic_write_bytes, read_own_json

log = logging.getLogger("kiln.stages.tokenize")

TOKENS_REMOTE_ENV = "KILN_TOKENS_REMOTE"
"""An ``s3://bucket/prefix`` to publish packed tokens to; the training manifest then names the
remote copy, and ranks stream it into a bounded local cache (``kiln_trainer.remote``). The
endpoint is ``KILN_DVC_REMOTE_ENDPOINT`` (the moto server in tests). Unset: ranks read the local
copy, which must then be on a filesystem every node sees."""


def _recipe(policy: Policy, params: dict[str, Any]):  # -> (kiln_trainer.config.Recipe, recipe path)
    recipe_path, _nodes, overrides = train_inputs(policy, params)
    return load_run_recipe(recipe_path, overrides), recipe_path


def _shard_set(manifest: TrainingManifest) -> str:
    """The healthy shards, by content, and the rows the contract dropped from them: what a packed
    corpus was made of besides its tokenizer (a shard without a drop list hashes as it always did)."""
    shards = [s["sha256"] if not s.get("drop_rows") else [s["sha256"], s["drop_rows"]] for s in manifest.shards]
    return hashlib.sha256(canonical_json(shards)).hexdigest()[:16]


def _texts(shards: list[dict[str, Any]]) -> Any:
    """The documents of these manifest shards the trainer may see: the contract's dropped rows left out
    (``kiln_trainer.packed.iter_training_texts``, the one reader both packers use)."""
    from kiln_trainer.packed import iter_training_texts

    return iter_training_texts(_entries_of(shards))


def _entries_of(shards: list[dict[str, Any]]) -> list[Any]:
    from kiln_trainer.contract.training_manifest import ShardEntry

    return [ShardEntry(path=s["path"], sha256=s["sha256"], rows=int(s["rows"]), drop_rows=tuple(s.get("drop_rows") or ()))
            for s in shards]


def _gate_manifest(key: str, data: DataGateResult) -> TrainingManifest:
    """The run's training manifest as its data gate made it (without tokens): what is packed."""
    _path, manifest = own_training_manifest(key, data)
    return manifest.without_tokens()


def _is_mixture(manifest: TrainingManifest) -> bool:
    return manifest.format == MIXTURE_FORMAT and manifest.sources is not None


def _source_manifest(source: dict[str, Any]) -> TrainingManifest:
    """A mixture source as the one-corpus manifest of its shards: packed into the folder (shard set,
    content address) a run of that corpus alone under that contract packs them into, so either reuses
    the other's token shards."""
    return TrainingManifest.build(snapshot_id=source["snapshot_id"], corpus=source["corpus"],
                                  contract=source["contract"], shards=source["shards"],
                                  eval_shards=source.get("eval_shards", []), quarantined=source.get("quarantined", []))


def _tokenizer_texts(manifest: TrainingManifest) -> Any:
    """The documents a BPE tokenizer trains on: one corpus' in shard order; a mixture's interleaved by
    weight (smooth weighted round robin, deterministic), so a tokenizer capped at ``max_train_chars``
    sees the sources in their declared proportions rather than the first source alone."""
    if not _is_mixture(manifest):
        return _texts(manifest.shards)
    assert manifest.sources is not None
    return _interleaved([_texts(src["shards"]) for src in manifest.sources], [float(src["weight"]) for src in manifest.sources])


def _interleaved(texts: list[Any], weights: list[float]) -> Any:
    """One document at a time from each stream in turn, in proportion to ``weights``, until all run out."""
    streams = [iter(t) for t in texts]
    credit = [0.0] * len(streams)
    live = list(range(len(streams)))
    while live:
        total = sum(weights[i] for i in live)
        for i in live:
            credit[i] += weights[i]
        pick = max(live, key=lambda i: (credit[i], -i))
        credit[pick] -= total
        try:
            yield next(streams[pick])
        except StopIteration:
            live.remove(pick)


def _load_tokenizer(ref: TokenizerRef, eos_token: str):  # -> kiln_trainer.tokenizer.Tokenizer
    """The run's tokenizer artifact, read with the recipe's EOS token (the one it was built with)."""
    from kiln_trainer.contract import TokenizerError
    from kiln_trainer.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(ref.path, eos_token=eos_token)
    except TokenizerError as exc:
        raise ManifestError(f"tokenizer {ref.path}: {exc}") from exc
    if tokenizer.sha256 != ref.sha256:
        raise ManifestError(f"tokenizer {ref.path} hashes to {tokenizer.sha256}, not the {ref.sha256} the run chose")
    return tokenizer


def _out_dir(manifest: TrainingManifest, tokenizer: Any, block_size: int, root: Path | None = None) -> Path:
    """Where a packed corpus lives: ``root`` (default ``KILN_HOME/tokens``), its shard set, its content address."""
    from kiln_trainer.packed import token_shards_key

    key = token_shards_key(snapshot_id=manifest.snapshot_id, tokenizer_sha256=tokenizer.sha256,
                           eos_id=tokenizer.eos_id, block_size=block_size)
    return (root or kiln_settings.load().home / "tokens") / _shard_set(manifest) / key


def tokenizer_stage(policy: Policy, data: DataGateResult, params: dict[str, Any], key: str) -> TokenizerRef:
    """The run's tokenizer, built (or found) and stored by its sha256."""
    from kiln_trainer.contract import TokenizerError
    from kiln_trainer.tokenizer import build_tokenizer

    manifest = _gate_manifest(key, data)
    recipe, recipe_path = _recipe(policy, params)
    cfg = recipe.tokenizer
    store = kiln_settings.load().home / "tokenizers"
    inputs: dict[str, Any] = {"shards": _shard_set(manifest),
                              "tokenizer": {"vocab_size": cfg.vocab_size, "eos_token": cfg.eos_token,
                                            "max_train_chars": cfg.max_train_chars}}
    if _is_mixture(manifest):  # which documents it sees also depends on the weights (_tokenizer_texts)
        assert manifest.sources is not None
        inputs["mixture"] = [[src["name"], src["weight"]] for src in manifest.sources]
    trained = store / f"bpe-{hashlib.sha256(canonical_json(inputs)).hexdigest()[:32]}.json"
    try:
        if cfg.kind == "bpe" and trained.is_file():  # trained before on exactly these shards
            tokenizer = _load_tokenizer(TokenizerRef.from_json(read_own_json(trained)), cfg.eos_token)
        else:
            tokenizer = build_tokenizer(cfg, recipe_path=recipe_path,
                                        training_texts=lambda: _tokenizer_texts(manifest))
    except TokenizerError as exc:
        raise ConfigError(f"recipe {recipe_path} [tokenizer]: {exc}") from exc
    path = store / f"{tokenizer.sha256}.json"
    if not (path.is_file() and path.read_bytes() == tokenizer.to_bytes()):
        atomic_write_bytes(path, tokenizer.to_bytes())
    ref = TokenizerRef(kind=cfg.kind, sha256=tokenizer.sha256, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                       path=str(path))
    if cfg.kind == "bpe":
        atomic_write_bytes(trained, json.dumps(ref.to_json(), sort_keys=True).encode())
    log.info("tokenizer %s: %s, %d ids, EOS %d (%s)", tokenizer.sha256[:16], cfg.kind, tokenizer.vocab_size,
             tokenizer.eos_id, path)
    return ref


def token_parts(policy: Policy, data: DataGateResult) -> list[list[int]]:
    """The healthy shards' indexes cut into the batches the mapped tokenize tasks take, in order
    (the validation batches' size: a batch is one task's worth of reading)."""
    count = data.healthy
    size = max(policy.validation_batch_shards, -(-count // policy.validation_max_tasks))
    return [list(range(i, min(i + size, count))) for i in range(0, count, size)]


def tokenize_stage(policy: Policy, data: DataGateResult, tokenizer: TokenizerRef, parts: list[int],
                   params: dict[str, Any], key: str) -> list[PackedPart]:
    """Pack shards ``parts`` of the run's manifest (one part each); a part already packed from the
    same inputs is kept."""
    from kiln_trainer.packed import pack_part

    manifest = _gate_manifest(key, data)
    recipe, _recipe_path = _recipe(policy, params)
    tok = _load_tokenizer(tokenizer, recipe.tokenizer.eos_token)
    shards = manifest.shards
    bad = [p for p in parts if not 0 <= p < len(shards)]
    if bad:
        raise RunMismatchError(f"run {key}: parts {bad} are no shard of its manifest ({len(shards)} shards)")
    # Part p is shard p of the manifest; a mixture's shards are its sources' in order, each source packed
    # into its own folder as part (p - the shards of the sources before it).
    where = [(_out_dir(manifest, tok, recipe.model.block_size), p) for p in range(len(shards))]
    if _is_mixture(manifest):
        assert manifest.sources is not None
        where = [(_out_dir(_source_manifest(src), tok, recipe.model.block_size), local)
                 for src in manifest.sources for local in range(len(src["shards"]))]
    packed = []
    for part in parts:
        out, local = where[part]
        # The contract's dropped documents (drop_rows) are left out here: they never reach a token shard.
        record = pack_part(_texts([shards[part]]), tok, out, part=local, block_size=recipe.model.block_size)
        packed.append(PackedPart(part=part, samples=sum(int(s["samples"]) for s in record["shards"]),
                                 tokens=int(record["tokens"]), documents=int(record["documents"]),
                                 dropped_tokens=int(record["dropped_tokens"])))
    return packed


def tokens_stage(policy: Policy, data: DataGateResult, tokenizer: TokenizerRef, params: dict[str, Any],
                 key: str) -> DataGateResult:
    """Join the packed parts into the token manifest and make the run's training manifest name it.

    Idempotent: a committed token manifest of these inputs is reused (its shards' sizes checked),
    and a training manifest that already names it is left as it is."""

    manifest = _gate_manifest(key, data)
    recipe, _recipe_path = _recipe(policy, params)
    tok = _load_tokenizer(tokenizer, recipe.tokenizer.eos_token)
    block_size = recipe.model.block_size
    if _is_mixture(manifest):
        return _mixture_tokens(manifest, data, tokenizer, tok, block_size, key)
    packed, location = _join_packed(manifest, tok, block_size, key)
    final = manifest.with_tokens(location, packed.sha256)
    path, recorded = own_training_manifest(key, data)
    if recorded.sha256 != final.sha256:
        final.write(path)
    log.info("run %s: %d samples of %d tokens (%d documents) at %s; training manifest %s", key, packed.samples,
             block_size + 1, packed.documents, location, final.sha256[:16])
    summary = PackedTokensRef(
        token_manifest=location, token_manifest_sha256=packed.sha256, tokenizer_kind=tokenizer.kind,
        tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size, block_size=block_size, samples=packed.samples,
        tokens=packed.tokens, documents=packed.documents,
    )
    return DataGateResult.from_json({**data.to_json(), "manifest": str(path), "manifest_sha256": final.sha256,
                                     "tokens": summary.to_json()})


def _join_packed(manifest: TrainingManifest, tok: Any, block_size: int, key: str) -> tuple[Any, str]:
    """The packed parts of ``manifest``'s shards joined into their token manifest (or the committed one
    found, its shards' sizes checked), published when ``KILN_TOKENS_REMOTE`` says so; and where the
    training manifest is to find it."""
    from kiln_trainer.contract import TrainerError
    from kiln_trainer.packed import TOKEN_MANIFEST_NAME, load_token_manifest, verify_token_shards, write_token_manifest

    out = _out_dir(manifest, tok, block_size)
    try:
        if (out / TOKEN_MANIFEST_NAME).is_file():
            packed = load_token_manifest(out)
            verify_token_shards(packed)
        else:
            packed = write_token_manifest(out, snapshot_id=manifest.snapshot_id, tokenizer=tok, block_size=block_size,
                                          parts=len(manifest.shards))
    except TrainerError as exc:
        raise ManifestError(f"packed tokens {out} of run {key}: {exc}") from exc
    location = str(out / TOKEN_MANIFEST_NAME)
    remote = os.environ.get(TOKENS_REMOTE_ENV, "").rstrip("/")
    if remote:
        from kiln_trainer.remote import publish_token_shards

        url = publish_token_shards(packed, f"{remote}/{out.parent.name}/{out.name}",
                                   endpoint_url=kiln_settings.load().dvc_remote_endpoint)
        location = f"{url}/{TOKEN_MANIFEST_NAME}"
    return packed, location


def _mixture_packed(manifest: TrainingManifest, packed: list[tuple[Any, str]], kind: str, tok: Any,
                    block_size: int) -> tuple[TrainingManifest, PackedTokensRef, dict[str, PackedTokensRef]]:
    """A mixture's packed tokens, as ``tokens_stage`` and ``pack_afresh`` record them: ``packed`` is each
    source's token manifest and where it lies, in ``manifest.sources``' order. Returns the training
    manifest naming every one of them (with the tokenizer and block size), the run's summary (the
    sources' token manifests' sha256 joined by ``TrainingManifest.tokens_sha256``) and each source's
    own summary by name."""
    assert manifest.sources is not None
    sources, summaries = [], {}
    for src, (one, location) in zip(manifest.sources, packed, strict=True):
        sources.append({**src, "tokens": {"manifest": location, "sha256": one.sha256,
                                          "tokenizer_sha256": tok.sha256, "block_size": block_size}})
        summaries[src["name"]] = PackedTokensRef(
            token_manifest=location, token_manifest_sha256=one.sha256, tokenizer_kind=kind,
            tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size, block_size=block_size, samples=one.samples,
            tokens=one.tokens, documents=one.documents)
    final = TrainingManifest.build_mixture(sources, trainer=manifest.trainer)
    total = list(summaries.values())
    summary = PackedTokensRef(
        token_manifest=",".join(f"{n}={s.token_manifest}" for n, s in summaries.items()),
        token_manifest_sha256=str(final.tokens_sha256()), tokenizer_kind=kind, tokenizer_sha256=tok.sha256,
        vocab_size=tok.vocab_size, block_size=block_size, samples=sum(s.samples for s in total),
        tokens=sum(s.tokens for s in total), documents=sum(s.documents for s in total),
    )
    return final, summary, summaries


def _mixture_tokens(manifest: TrainingManifest, data: DataGateResult, tokenizer: TokenizerRef, tok: Any,
                    block_size: int, key: str) -> DataGateResult:
    """``tokens_stage`` for a mixture: each source's parts joined into its own token manifest, and the
    run's training manifest rewritten to name every one of them with the tokenizer and block size."""
    assert manifest.sources is not None
    packed = [_join_packed(_source_manifest(src), tok, block_size, key) for src in manifest.sources]
    final, summary, summaries = _mixture_packed(manifest, packed, tokenizer.kind, tok, block_size)
    path, recorded = own_training_manifest(key, data)
    if recorded.sha256 != final.sha256:
        final.write(path)
    log.info("run %s: mixture of %s: %d samples of %d tokens; training manifest %s", key,
             ", ".join(f"{n} ({s.samples} samples)" for n, s in summaries.items()), summary.samples,
             block_size + 1, final.sha256[:16])
    gates = [dataclasses.replace(g, tokens=summaries.get(g.name)) for g in data.sources or []]
    return dataclasses.replace(data, manifest=str(path), manifest_sha256=final.sha256, tokens=summary,
                               sources=gates or None)


def pack_afresh(manifest: TrainingManifest, recipe: Any, recipe_path: Path | None,
                root: Path) -> tuple[TrainingManifest, PackedTokensRef]:
    """The tokenizer, tokenize and tokens stages in one process, for ``kiln reproduce``: the tokenizer the
    recipe (a ``kiln_trainer.config.Recipe``) asks for, built from the gate manifest's shards as
    ``tokenizer_stage`` builds it (a mixture's interleaved by weight) and never taken from kiln's store,
    stored and read back under ``root/tokenizers``; every shard packed (part ``i`` is shard ``i``; a
    mixture's each source into its own folder, as ``tokenize_stage`` packs them) under ``root/tokens``; the
    token manifest written (a mixture's one per source). Returns ``manifest`` naming the packed tokens, and
    their summary (a mixture's as ``tokens_stage`` makes it: its sources' token manifests' sha256 joined by
    ``TrainingManifest.tokens_sha256``). ``ConfigError`` for a tokenizer the recipe cannot make; nothing of
    kiln's home is read or written."""
    from kiln_trainer.contract import TokenizerError, TrainerError
    from kiln_trainer.packed import TOKEN_MANIFEST_NAME, pack_part, write_token_manifest
    from kiln_trainer.tokenizer import build_tokenizer

    if manifest.packed:
        raise ManifestError("pack_afresh packs a data gate's manifest, which names no packed tokens yet")
    cfg = recipe.tokenizer
    try:
        built = build_tokenizer(cfg, recipe_path=recipe_path, training_texts=lambda: _tokenizer_texts(manifest))
    except TokenizerError as exc:
        raise ConfigError(f"recipe [tokenizer]: {exc}") from exc
    stored = root / "tokenizers" / f"{built.sha256}.json"
    atomic_write_bytes(stored, built.to_bytes())
    tok = _load_tokenizer(TokenizerRef(kind=cfg.kind, sha256=built.sha256, vocab_size=built.vocab_size,
                                       eos_id=built.eos_id, path=str(stored)), cfg.eos_token)
    block_size = recipe.model.block_size

    def pack(one: TrainingManifest) -> tuple[Any, str]:
        out = _out_dir(one, tok, block_size, root / "tokens")
        try:
            for part, shard in enumerate(one.shards):
                pack_part(_texts([shard]), tok, out, part=part, block_size=block_size)
            packed = write_token_manifest(out, snapshot_id=one.snapshot_id, tokenizer=tok, block_size=block_size,
                                          parts=len(one.shards))
        except TrainerError as exc:
            raise ManifestError(f"packed tokens {out}: {exc}") from exc
        return packed, str(out / TOKEN_MANIFEST_NAME)

    if _is_mixture(manifest):
        assert manifest.sources is not None
        final, summary, _ = _mixture_packed(manifest, [pack(_source_manifest(src)) for src in manifest.sources],
                                            cfg.kind, tok, block_size)
        return final, summary
    packed, location = pack(manifest)
    summary = PackedTokensRef(
        token_manifest=location, token_manifest_sha256=packed.sha256, tokenizer_kind=cfg.kind,
        tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size, block_size=block_size, samples=packed.samples,
        tokens=packed.tokens, documents=packed.documents,
    )
    return manifest.with_tokens(location, packed.sha256), summary
