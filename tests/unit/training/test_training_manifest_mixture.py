"""The TrainingManifest's format 2, a mixture of sources: kiln's writer (``kiln.refs.TrainingManifest``)
and the trainer's reader (``kiln_trainer.contract.training_manifest``) agree on it under the one hash
rule; a format-1 manifest reads and hashes as it always did; every malformed mixture is refused
naming its field, on both sides."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from kiln.errors import ManifestError
from kiln.refs import TrainingManifest as KilnManifest
from kiln_trainer.contract import TRAINING_MANIFEST_KIND, training_manifest_sha256
from kiln_trainer.contract.training_manifest import (
    check_training_manifest,
    load_training_manifest,
    mixture_summary,
    mixture_tokens_sha256,
)
from kiln_trainer.errors import TrainingManifestError

FIXED_V1 = {
    "snapshot_id": "0123456789abcdef0123456789abcdef.dir",
    "corpus": "web-ü",
    "contract": "web@1",
    "shards": [{"path": "/data/train/part-0.parquet", "sha256": "a" * 64, "rows": 10},
               {"path": "/data/train/part-1.parquet", "sha256": "b" * 64, "rows": 4, "drop_rows": [0, 3]}],
    "eval_shards": [{"path": "/data/eval/part-0.parquet", "sha256": "c" * 64, "rows": 2}],
    "quarantined": ["/data/train/bad.parquet"],
}
FIXED_V1_SHA256 = "d650c8182129809f19460721bbacfadeada6ee531b5e03aa90955cce286ab47c"
"""The hash this manifest had before the contract existed (tests/unit/training/test_contract.py)."""
FIXED_V1_TOKENS = {"manifest": "/data/tokens/token_manifest.json", "sha256": "d" * 64}
FIXED_V1_WITH_TOKENS_SHA256 = "d2d277bafdda9e5a80304634a17c2d069ef26d53904e91b7c3c075c1fc2fccc5"

TOKENIZER = "e" * 64


def source(name: str, weight: Any = 1.0, **change: Any) -> dict[str, Any]:
    entry = {
        "name": name, "weight": weight, "corpus": f"{name}-corpus", "snapshot_id": f"{name:0<32}.dir"[-36:],
        "contract": f"{name}-text@1",
        "shards": [{"path": f"/data/{name}/train/part-0.parquet", "sha256": "a" * 64, "rows": 10}],
        "eval_shards": [{"path": f"/data/{name}/eval/part-0.parquet", "sha256": "c" * 64, "rows": 2}],
        "quarantined": [f"/data/{name}/train/bad.parquet"],
        "tokens": {"manifest": f"/data/{name}/tokens/token_manifest.json", "sha256": "f" * 64,
                   "tokenizer_sha256": TOKENIZER, "block_size": 64},
    }
    return {**entry, **change}


FIXED_MIXTURE = [source("web", 0.7), source("code", 0.2, shards=[
    {"path": "/data/code/train/part-0.parquet", "sha256": "b" * 64, "rows": 7, "drop_rows": [1]}]), source("books", 0.1)]
FIXED_MIXTURE_SHA256 = "42ce178322003f4652ddee273c4ba71f487f34517a4d8b1d4d9fd16b8de6fc68"
"""Pinned: format 2's wire form cannot change unnoticed either."""


def wire(sources: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    body = {"format": 2, "sources": sources, **top}
    return {"kind": TRAINING_MANIFEST_KIND, **body, "sha256": training_manifest_sha256(body)}


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


# ------------------------------------------------------------------ format 1, as it always was


def test_a_format_1_manifest_reads_and_hashes_as_before(tmp_path: Path):
    for body, digest in ((FIXED_V1, FIXED_V1_SHA256), ({**FIXED_V1, "tokens": FIXED_V1_TOKENS}, FIXED_V1_WITH_TOKENS_SHA256)):
        read = load_training_manifest(write(tmp_path / "m.json", {"kind": TRAINING_MANIFEST_KIND, **body, "sha256": digest}))
        assert (read.sha256, read.format, read.sources, read.is_mixture) == (digest, 1, (), False)
        [only] = read.data_sources
        assert (only.name, only.weight, only.corpus, only.snapshot_id, only.contract) == (
            "web-ü", 1.0, "web-ü", FIXED_V1["snapshot_id"], "web@1")
        assert only.shards == read.shards and only.eval_shards == read.eval_shards and only.tokens == read.tokens
        assert read.tokens_sha256 == (None if "tokens" not in body else "d" * 64)
    kiln = KilnManifest.build(**copy.deepcopy(FIXED_V1))
    assert kiln.sha256 == FIXED_V1_SHA256 and "format" not in kiln.to_json() and "sources" not in kiln.to_json()
    assert kiln.with_tokens(FIXED_V1_TOKENS["manifest"], "d" * 64).sha256 == FIXED_V1_WITH_TOKENS_SHA256
    assert kiln.tokens_sha256() is None
    # An explicit "format": 1 is format 1 (under its own hash: every key is hashed).
    explicit = {**FIXED_V1, "format": 1}
    assert check_training_manifest(explicit, "m").format == 1


# ------------------------------------------------------------------ format 2: the round trip


def test_the_writer_builds_what_the_reader_reads_under_one_hash(tmp_path: Path):
    trainer = {"spec": "kiln", "distribution": "kiln-trainer", "version": "0.1.0"}
    built = KilnManifest.build_mixture(copy.deepcopy(FIXED_MIXTURE), trainer=trainer)
    untrained = KilnManifest.build_mixture(copy.deepcopy(FIXED_MIXTURE))
    assert untrained.sha256 == FIXED_MIXTURE_SHA256 == training_manifest_sha256({"format": 2, "sources": FIXED_MIXTURE})
    assert built.sha256 != untrained.sha256 and untrained.with_trainer(trainer) == built
    doc = built.to_json()
    assert set(doc) == {"kind", "format", "sources", "trainer", "sha256"}, "no single-source key on the wire"
    path = built.write(tmp_path / "m.json")
    read = load_training_manifest(path)
    assert read.sha256 == built.sha256 and read.format == 2 and read.is_mixture and read.trainer == trainer
    assert KilnManifest.read(path) == built
    assert [(s.name, s.weight, s.corpus, s.snapshot_id, s.contract) for s in read.sources] == [
        (s["name"], s["weight"], s["corpus"], s["snapshot_id"], s["contract"]) for s in FIXED_MIXTURE]
    assert read.sources[1].shards[0].drop_rows == (1,) and read.sources[2].tokens is not None
    assert read.sources[2].tokens.tokenizer_sha256 == TOKENIZER and read.sources[2].tokens.block_size == 64
    # The single-valued fields answer for every source, the same on both sides.
    summary = mixture_summary(FIXED_MIXTURE)
    assert read.snapshot_id == built.snapshot_id == summary["snapshot_id"] == ",".join(
        f"{s['name']}={s['snapshot_id']}" for s in FIXED_MIXTURE)
    assert read.contract == built.contract == "web=web-text@1,code=code-text@1,books=books-text@1"
    assert [s.path for s in read.shards] == [s["path"] for s in built.shards] == [
        s["shards"][0]["path"] for s in FIXED_MIXTURE]
    assert len(read.eval_shards) == len(built.eval_shards) == 3 and len(read.quarantined) == len(built.quarantined) == 3
    assert read.tokens is None and built.tokens is None
    assert read.tokens_sha256 == built.tokens_sha256() == mixture_tokens_sha256(
        [("web", 0.7, "f" * 64), ("code", 0.2, "f" * 64), ("books", 0.1, "f" * 64)])
    # An edit after issue is refused by both readers.
    write(path, {**doc, "sources": [{**FIXED_MIXTURE[0], "weight": 0.8}, *FIXED_MIXTURE[1:]]})
    with pytest.raises(TrainingManifestError, match="content hash mismatch"):
        load_training_manifest(path)
    with pytest.raises(ManifestError, match="content hash does not match"):
        KilnManifest.read(path)


def test_a_mixture_of_one_source_names_its_tokens_and_tokens_sha256_is_its_token_manifest(tmp_path: Path):
    one = KilnManifest.build_mixture([source("web")])
    read = load_training_manifest(one.write(tmp_path / "m.json"))
    assert not read.is_mixture and read.tokens == read.sources[0].tokens and one.tokens == source("web")["tokens"]
    assert read.tokens_sha256 == one.tokens_sha256() == "f" * 64
    assert read.snapshot_id == one.snapshot_id == f"web={source('web')['snapshot_id']}"


def test_the_writer_replaces_one_sources_tokens_under_a_new_hash():
    built = KilnManifest.build_mixture(copy.deepcopy(FIXED_MIXTURE))
    tokens = {**FIXED_MIXTURE[1]["tokens"], "sha256": "9" * 64}
    again = built.with_source_tokens("code", tokens)
    assert again.sources is not None and again.sources[1]["tokens"] == tokens and again.sha256 != built.sha256
    assert again.sources[0] == FIXED_MIXTURE[0] and again.verify() is again
    with pytest.raises(ManifestError, match=r"unknown source 'prose'.*\['web', 'code', 'books'\]"):
        built.with_source_tokens("prose", tokens)
    with pytest.raises(ManifestError, match=r"sources\[1\] \('code'\)\.tokens\.tokenizer_sha256"):
        built.with_source_tokens("code", {**tokens, "tokenizer_sha256": "1" * 64})
    with pytest.raises(ManifestError, match="per source"):
        built.with_tokens("/x/token_manifest.json", "1" * 64)
    with pytest.raises(ManifestError, match="format-1"):
        KilnManifest.build(**copy.deepcopy(FIXED_V1)).with_source_tokens("web", tokens)


def test_a_sources_caps_are_carried_hashed_and_read_when_present(tmp_path: Path):
    """``max_epochs`` and ``max_tokens`` are optional source keys: absent, the hash is what it was."""
    plain = KilnManifest.build_mixture(copy.deepcopy(FIXED_MIXTURE))
    sources = copy.deepcopy(FIXED_MIXTURE)
    sources[2]["max_epochs"] = 2
    sources[0]["max_tokens"] = 10**6
    capped = KilnManifest.build_mixture(sources)
    assert capped.sha256 != plain.sha256 and capped.sources is not None and capped.sources[2]["max_epochs"] == 2
    read = load_training_manifest(capped.write(tmp_path / "capped.json"))
    assert read.sha256 == capped.sha256
    assert [(s.max_epochs, s.max_tokens) for s in read.data_sources] == [(None, 10**6), (None, None), (2, None)]
    assert [(s.max_epochs, s.max_tokens) for s in load_training_manifest(plain.write(tmp_path / "p.json")).data_sources] \
        == [(None, None)] * 3


# ------------------------------------------------------------------ refusals, each naming its field

REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("format", wire(FIXED_MIXTURE) | {"format": 3}, "format = 3: this trainer reads TrainingManifest formats 1, 2"),
    ("sources-without-format", {"kind": TRAINING_MANIFEST_KIND, **FIXED_V1, "sources": FIXED_MIXTURE}, "'sources' is format 2's"),
    ("top-level-shards", wire(FIXED_MIXTURE, shards=FIXED_V1["shards"]), r"unexpected top-level key\(s\) \['shards'\]"),
    ("no-sources", wire([]), "'sources' must be a non-empty list"),
    ("not-an-object", wire(["web"]), r"sources\[0\] must be an object"),
    ("bad-name", wire([source("Web")]), r"sources\[0\]\.name = 'Web': must be 1-64 characters"),
    ("duplicate", wire([source("web"), source("code"), source("web")]),
     r"sources\[2\]\.name = 'web': duplicate, sources\[0\] has the same name"),
    ("metric-name", wire([source("web-a"), source("web_a")]), r"sources\[1\]\.name = 'web_a': its metrics would share"),
    ("unknown-key", wire([source("web"), {**source("code"), "wieght": 2}]),
     r"sources\[1\] \('code'\): unknown key\(s\) \['wieght'\]"),
    ("no-tokens", wire([source("web"), {k: v for k, v in source("code").items() if k != "tokens"}]),
     r"sources\[1\] \('code'\)\.tokens: the source names no packed tokens while others do"),
    ("null-tokens", wire([source("web", tokens=None), source("code")]),
     r"sources\[0\] \('web'\)\.tokens: the source names no packed tokens while others do"),
    ("max-epochs-zero", wire([source("web", max_epochs=0)]),
     r"sources\[0\] \('web'\)\.max_epochs = 0: must be an int >= 1 \(absent: no cap\)"),
    ("max-tokens-float", wire([source("web"), source("code", max_tokens=1.5)]), r"sources\[1\] \('code'\)\.max_tokens = 1\.5"),
    ("max-tokens-null", wire([source("web", max_tokens=None)]), r"sources\[0\] \('web'\)\.max_tokens = None"),
    ("no-corpus", wire([{k: v for k, v in source("web").items() if k != "corpus"}]), r"sources\[0\] \('web'\) lacks 'corpus'"),
    ("empty-contract", wire([source("web", contract="")]), r"sources\[0\] \('web'\)\.contract = '': must be a non-empty"),
    ("weight-zero", wire([source("web"), source("code", 0)]),
     r"sources\[1\] \('code'\)\.weight = 0: must be a finite number > 0"),
    ("weight-negative", wire([source("web", -0.5)]), r"sources\[0\] \('web'\)\.weight = -0.5"),
    ("weight-text", wire([source("web", "0.5")]), r"sources\[0\] \('web'\)\.weight = '0.5'"),
    ("weight-bool", wire([source("web", True)]), r"sources\[0\] \('web'\)\.weight = True"),
    ("no-shards", wire([source("web"), source("code", shards=[])]),
     r"sources\[1\] \('code'\)\.shards is empty: the source has no healthy shard"),
    ("relative-shard", wire([source("web", shards=[{"path": "train/a.parquet", "sha256": "a" * 64, "rows": 1}])]),
     r"sources\[0\] \('web'\)\.shards\[0\]\.path must be an absolute path"),
    ("bad-eval-shard", wire([source("web", eval_shards=[{"path": "/e.parquet", "sha256": "a" * 64}])]),
     r"sources\[0\] \('web'\)\.eval_shards\[0\] lacks 'rows'"),
    ("quarantined", wire([source("web", quarantined="bad.parquet")]), r"sources\[0\] \('web'\)\.quarantined must be a list"),
    ("format-1-tokens", wire([source("web", tokens=FIXED_V1_TOKENS)]),
     r"sources\[0\] \('web'\)\.tokens must be an object with exactly 'block_size' and 'manifest' and 'sha256' and "
     "'tokenizer_sha256'"),
    ("tokenizer-sha256", wire([source("web", tokens={**source("web")["tokens"], "tokenizer_sha256": "E" * 64})]),
     r"sources\[0\] \('web'\)\.tokens\.tokenizer_sha256 must be 64 lowercase hex"),
    ("block-size", wire([source("web", tokens={**source("web")["tokens"], "block_size": 0})]),
     r"sources\[0\] \('web'\)\.tokens\.block_size must be an int >= 1"),
    ("tokenizer-mismatch", wire([source("web"), source("code"), source("books", tokens={
        **source("books")["tokens"], "tokenizer_sha256": "1" * 64})]),
     r"sources\[2\] \('books'\)\.tokens\.tokenizer_sha256 = 1{64} differs from "
     r"sources\[0\] \('web'\)\.tokens\.tokenizer_sha256 = e{64}"),
    ("block-size-mismatch", wire([source("web"), source("code", tokens={**source("code")["tokens"], "block_size": 128})]),
     r"sources\[1\] \('code'\)\.tokens\.block_size = 128 differs from sources\[0\] \('web'\)\.tokens\.block_size = 64"),
]


@pytest.mark.parametrize(("doc", "message"), [(d, m) for _, d, m in REFUSALS], ids=[i for i, _, _ in REFUSALS])
def test_a_malformed_mixture_is_refused_naming_the_field(tmp_path: Path, doc: dict[str, Any], message: str):
    """By the trainer's reader (from the file, under a valid hash) and by kiln's writer and reader."""
    doc = {**doc, "sha256": training_manifest_sha256(doc)}
    with pytest.raises(TrainingManifestError, match=message):
        load_training_manifest(write(tmp_path / "m.json", doc))
    if doc.get("format") == 2 and isinstance(doc.get("sources"), list):
        with pytest.raises(ManifestError, match=message):
            KilnManifest.read(tmp_path / "m.json")
        if all(isinstance(s, dict) for s in doc["sources"]) and set(doc) <= {"kind", "format", "sources", "sha256"}:
            with pytest.raises(ManifestError, match=message):
                KilnManifest.build_mixture(doc["sources"])


@pytest.mark.parametrize("weight", [math.inf, -math.inf, math.nan])
def test_a_weight_that_is_not_finite_is_refused(weight: float):
    """JSON as Python reads it may spell them (``Infinity``, ``NaN``)."""
    with pytest.raises(TrainingManifestError, match=r"sources\[1\] \('code'\)\.weight = (-?inf|nan): must be a finite"):
        check_training_manifest(wire([source("web"), source("code", weight)]), "m.json")
    with pytest.raises(ManifestError, match=r"sources\[1\] \('code'\)\.weight"):
        KilnManifest.build_mixture([source("web"), source("code", weight)])


def test_the_contracts_reader_and_kilns_writer_name_the_same_fields():
    """Both classes list format and sources: a key added on one side alone fails here (and in test_refs)."""
    import dataclasses

    from kiln_trainer.contract import training_manifest as contract_manifest

    theirs = {f.name for f in dataclasses.fields(contract_manifest.TrainingManifest)} - {"path"}
    assert {f.name for f in dataclasses.fields(KilnManifest)} == theirs >= {"format", "sources"}
