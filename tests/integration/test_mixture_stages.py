"""A data mixture through the DAG's stages in process, on real snapshots and a real MLflow server: two
corpora, each under its own contract, snapshotted as a set -> validated in batches of one source each ->
gated each by its own threshold -> one BPE tokenizer over both -> each packed -> the run's format-2
training manifest -> trained (torchrun) -> evaluated -> registered with its lineage per source, in the
tags and the signed statement. And the refusals: a source that
breaches its gate stops the run naming it (every source's report written first), a corpus that is not
there, a contract that does not fit its corpus, a contract asked for beside a mixture."""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from kiln import runs, stages
from kiln.errors import ConfigError, DataGateError, RunMismatchError
from kiln.policy import SANDBOX
from kiln.refs import DataGateResult, PinnedMixture, ShardReport, TrainingManifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "kiln" / "data"))  # the prose fixture

from webtext_fixtures import poisoned, prose_documents, split, table, write_corpus

pytestmark = pytest.mark.slow
KEY = "kiln_sandbox/manual__mixture"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_uri: str) -> Path:
    """KILN_HOME with two corpora, ``code`` (the stdlib sample, one poisoned shard, its corpus.json
    naming stdlib-py@1) and ``prose`` (web text, one shard with PII), and a mixtures folder."""
    from kiln import settings as kiln_settings
    from kiln.data import mixtures
    from kiln.data.corpus import build_corpus, parquet_bytes

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.delenv("KILN_DVC_REMOTE", raising=False)
    monkeypatch.delenv("KILN_DVC_REMOTE_ENDPOINT", raising=False)
    root = kiln_settings.load().corpus_root
    build_corpus(root / "code", shards=3, seed=5, poison=("null_text",), max_bytes=150_000)
    docs = prose_documents()
    parts = split(docs[:120], 3)
    parts[2] = poisoned("pii", parts[2])
    write_corpus(root / "prose", parts)
    (root / "prose" / "eval").mkdir()
    (root / "prose" / "eval" / "eval-00000.parquet").write_bytes(parquet_bytes(table(docs[300:310])))
    folder = tmp_path / "mixtures"
    folder.mkdir()
    monkeypatch.setattr(mixtures, "mixtures_dir", lambda: folder)
    return folder


def write_mixture(folder: Path, name: str, sources: list[dict[str, Any]]) -> str:
    lines = [f'description = "{name} for a test"']
    for source in sources:
        lines.append("[[sources]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in source.items()]
    (folder / f"{name}.toml").write_text("\n".join(lines) + "\n")
    return name


CODE = {"name": "code", "corpus": "code", "weight": 0.7}
PROSE = {"name": "prose", "corpus": "prose", "contract": "web-text@1", "weight": 0.3, "max_quarantine_share": 0.5}


def validate_all(params: dict[str, Any], pinned: PinnedMixture) -> list[list[ShardReport]]:
    """What the mapped validate_shards tasks push, through their JSON."""
    batches = []
    for batch in stages.run_shard_batches(SANDBOX, pinned):
        reports = stages.validate_run_stage(SANDBOX, params, pinned, batch, KEY)
        batches.append([ShardReport.from_json(json.loads(json.dumps(r.as_xcom().to_json()))) for r in reports])
    return batches


def test_a_mixture_through_the_data_stages_to_a_manifest_the_trainer_trains(home: Path, tmp_path: Path) -> None:
    from kiln_trainer.packed import load_token_manifest

    capped = {**PROSE, "max_epochs": 50}  # a cap the run does not reach: recorded in the statement, re-derived
    params = {"mixture": write_mixture(home, "code-and-prose", [CODE, capped]), "recipe": "tiny-bpe.toml", "seed": 3,
              "max_steps": 22}
    pinned = stages.snapshot_run_stage(SANDBOX, params)
    assert isinstance(pinned, PinnedMixture) and [s.name for s in pinned.sources] == ["code", "prose"]
    assert pinned.id == ",".join(f"{s.name}={s.snapshot.id}" for s in pinned.sources)
    xcom = json.loads(json.dumps(pinned.to_json()))
    from kiln.refs import pinned_input

    assert pinned_input(xcom) == pinned

    plan = stages.run_shard_batches(SANDBOX, pinned)
    assert {entry.partition(":")[0] for batch in plan for entry in batch} == {"code", "prose"}
    assert all(len({e.partition(":")[0] for e in batch}) == 1 for batch in plan)  # a batch is one source's
    with pytest.raises(RunMismatchError, match="shards of one source"):
        stages.validate_run_stage(SANDBOX, params, pinned, [plan[0][0], plan[-1][-1]], KEY)
    batches = validate_all(params, pinned)
    contracts = {r.contract for batch in batches for r in batch}
    assert contracts == {"stdlib-py@1", "web-text@1"}  # each source by its own contract

    # The XComs of the sources must be the run's own: a rewritten snapshot XCom is refused.
    swapped = dataclasses.replace(pinned, sources=pinned.sources[::-1])
    with pytest.raises(RunMismatchError, match="declares"):
        stages.data_gate_run_stage(SANDBOX, params, swapped, batches, KEY)
    data = stages.data_gate_run_stage(SANDBOX, params, pinned, batches, KEY)
    data = DataGateResult.from_json(json.loads(json.dumps(data.to_json())))
    assert data.sources is not None and [g.name for g in data.sources] == ["code", "prose"]
    code, prose = data.sources
    assert (code.contract, prose.contract) == ("stdlib-py@1", "web-text@1")
    assert [q.path for q in code.quarantined] and [q.path for q in prose.quarantined] == ["shard-00002.parquet"]
    assert prose.max_quarantine_share == 0.5 and code.max_quarantine_share == SANDBOX.max_quarantine_share
    assert sorted(q.path for q in data.quarantined) == sorted(
        [f"code/{q.path}" for q in code.quarantined] + ["prose/shard-00002.parquet"])
    assert data.healthy == code.healthy + prose.healthy
    for gate in data.sources:  # each source's own report, logged under quarantine/<source>/
        report = json.loads(Path(gate.report).read_text())
        assert report["contract"] == [gate.contract] and Path(gate.report).parent.name == gate.name
        assert f"/quarantine/{gate.name}/" in gate.report_html_uri
    index = json.loads(Path(data.report).read_text())
    assert index["kind"] == "kiln.MixtureQuarantineReport" and [s["name"] for s in index["sources"]] == ["code", "prose"]

    manifest = TrainingManifest.read(data.manifest)
    assert manifest.format == 2 and manifest.sha256 == data.manifest_sha256 and not manifest.packed
    assert [(s["name"], s["weight"], s["contract"]) for s in manifest.sources or []] == [
        ("code", 0.7, "stdlib-py@1"), ("prose", 0.3, "web-text@1")]
    # A second try of the gate makes the same manifest (idempotent), and leaves it as it is.
    again = stages.data_gate_run_stage(SANDBOX, params, pinned, batches, KEY)
    assert again.manifest_sha256 == data.manifest_sha256

    tokenizer = stages.tokenizer_stage(SANDBOX, data, params, KEY)
    assert tokenizer.kind == "bpe"
    for batch in stages.token_parts(SANDBOX, data):
        stages.tokenize_stage(SANDBOX, data, tokenizer, batch, params, KEY)
    tokenized = stages.tokens_stage(SANDBOX, data, tokenizer, params, KEY)
    final = TrainingManifest.read(runs.run_dir(KEY) / runs.TRAINING_MANIFEST)
    assert final.packed and final.sha256 == tokenized.manifest_sha256 and final.tokens_sha256() is not None
    assert tokenized.tokens is not None and tokenized.tokens.token_manifest_sha256 == final.tokens_sha256()
    assert tokenized.sources is not None
    for src, gate in zip(final.sources or [], tokenized.sources, strict=True):
        packed = load_token_manifest(src["tokens"]["manifest"])
        assert src["tokens"]["tokenizer_sha256"] == tokenizer.sha256 and gate.tokens is not None
        assert packed.sha256 == src["tokens"]["sha256"] == gate.tokens.token_manifest_sha256
        assert packed.snapshot_id == src["snapshot_id"]  # each source packed as that corpus alone would be
    assert tokenized.tokens.samples == sum(g.tokens.samples for g in tokenized.sources if g.tokens)
    # Idempotent: the tokens stage again finds and keeps the same manifest.
    assert stages.tokens_stage(SANDBOX, data, tokenizer, params, KEY).manifest_sha256 == final.sha256

    # Trained, evaluated and registered as the DAG's tasks do; the version's lineage lists every source,
    # in its tags and in its signed statement, and an edited source tag is found by `kiln verify`.
    import mlflow

    from kiln.registry.verify import check_version

    name = f"sandbox.mixture-{uuid.uuid4().hex[:8]}"
    policy = dataclasses.replace(SANDBOX, candidate_model=name, target_model=name, writable_models=(name,))
    train = stages.train_stage(policy, pinned, tokenized, params, KEY, log_line=lambda _line: None)
    assert train.snapshot_id == pinned.id and train.training_manifest_sha256 == final.sha256
    evaluation = stages.evaluate_stage(train, tokenized, KEY)
    candidate = stages.register_stage(policy, pinned, tokenized, train, evaluation, KEY, lineage={})
    client = mlflow.MlflowClient()
    mv = client.get_model_version(name, candidate.version)
    drawn = {m["name"]: m for m in json.loads((runs.run_dir(KEY) / "train" / "result.json").read_text())["mixture"]}
    assert mv.tags["kiln.mixture.sources"] == "code,prose" and mv.tags["kiln.snapshot_id"] == pinned.id
    for src in final.sources or []:
        tag = f"kiln.source.{src['name']}."
        assert mv.tags[tag + "snapshot_id"] == src["snapshot_id"] and mv.tags[tag + "contract"] == src["contract"]
        assert float(mv.tags[tag + "weight"]) == src["weight"] and float(mv.tags[tag + "share"]) == drawn[src["name"]]["share"]
        assert int(mv.tags[tag + "tokens"]) == drawn[src["name"]]["tokens"] > 0
    assert abs(sum(float(mv.tags[f"kiln.source.{n}.share"]) for n in ("code", "prose")) - 1) < 1e-9
    assert "Data mixture" in mv.description and "| prose | prose | `" in mv.description  # the version page's table
    # Scored source by source, each on its own held-out split (one stream of both would score the code
    # only, once its text filled the window budget); the version's figure is their weighted mean.
    assert evaluation.sources is not None and [s["name"] for s in evaluation.sources] == ["code", "prose"]
    assert all(s["windows"] > 0 and s["bits_per_byte"] > 0 for s in evaluation.sources)
    weighted = sum(s["weight"] * s["bits_per_byte"] for s in evaluation.sources) / sum(s["weight"] for s in evaluation.sources)
    assert evaluation.bits_per_byte == pytest.approx(weighted, rel=1e-12)
    assert evaluation.sources[0]["bits_per_byte"] != evaluation.sources[1]["bits_per_byte"]
    for s in evaluation.sources:
        assert float(mv.tags[f"kiln.source.{s['name']}.eval_bits_per_byte"]) == s["bits_per_byte"]
        assert f"| {s['bits_per_byte']:.4f} |" in mv.description
    logged = client.get_run(candidate.run_id).data.metrics
    assert logged["eval_bits_per_byte_prose"] == evaluation.sources[1]["bits_per_byte"]
    check = check_version(mv, "sandbox")
    assert check.status == "agrees", check.problem
    assert check.verified is not None
    deps = {d["name"]: d for d in check.verified.statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert {"source:code", "source:prose"} <= set(deps)
    assert deps["source:prose"]["annotations"]["contract"] == "web-text@1"
    assert deps["source:prose"]["digest"]["md5"] == pinned.source("prose").snapshot.id.removesuffix(".dir")
    # The datasheet, made from the signed statement, lists each source and each source's held-out score.
    from kiln.provenance.datasheet import build_datasheet, datasheet_markdown

    sheet = datasheet_markdown(build_datasheet(check.verified.statement))
    for src in final.sources or []:
        assert f"| {src['name']} | {src['corpus']} | `{src['snapshot_id']}`" in sheet or \
            f"| {src['name']} | {src['corpus']} | {src['snapshot_id']}" in sheet, sheet
    assert "Sources of the mixture" in sheet and "Held-out score per source" in sheet
    for scored in evaluation.sources:
        assert f"| {scored['name']} | {scored['weight']:.6g} | {scored['bits_per_byte']:.6g} |" in sheet

    # Re-derived from the signed statement and the DVC remote: each source's snapshot, contract, quarantine
    # report and packed tokens, the one tokenizer, the format-2 training manifest (prose's cap with it: the
    # statement records it), the weights bit for bit, the per-source evaluation and the Hugging Face folder.
    from kiln.provenance.reproduce import reproduce

    assert deps["source:prose"]["annotations"]["max_epochs"] == 50 and "max_epochs" not in deps["source:code"]["annotations"]
    outcome = reproduce(name, candidate.version, by="version", policy="sandbox", workdir=tmp_path / "reproduce")
    assert outcome.verdict == "reproduced", "\n".join(outcome.in_words())
    said = [(c.step, c.input) for c in outcome.comparisons]
    for step, what in (("snapshot", "source prose: snapshot"), ("validate", "source code: quarantine report"),
                       ("validate", "source prose: quarantine report"), ("tokenize", "source prose: token manifest"),
                       ("tokenize", "token manifests of the sources, joined"), ("training-manifest", "training manifest"),
                       ("train", "weights"), ("evaluate", "evaluation report sources")):
        assert any(s == step and w.startswith(what) for s, w in said), (step, what, said)
    assert client.get_model_version(name, candidate.version).tags["kiln.reproduction.verdict"] == "reproduced"
    # Production's champion watch, for a production that trains this mixture (its reviewed [mixture]):
    # today's held-out split is every source's, so the champion's number is the one recorded at its
    # evaluation, bit for bit, not a one-corpus number that would read as a regression.
    from kiln.policy import build_production_policy, load_production_config
    from kiln.stages.champion_watch import evaluate_version, heldout_manifest

    config = tmp_path / "production.toml"
    config.write_text('model = "acme-lm"\n[mixture]\n' + "".join(
        "[[mixture.sources]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in source.items())
        for source in ({**CODE, "contract": "stdlib-py@1"}, PROSE)))
    production = build_production_policy(load_production_config(config))
    watched = stages.snapshot_run_stage(production, {})
    assert isinstance(watched, PinnedMixture) and watched.id == pinned.id
    heldout = TrainingManifest.read(heldout_manifest(watched, production, tmp_path))
    assert heldout.format == 2 and [s["name"] for s in heldout.sources or []] == ["code", "prose"]
    assert heldout.eval_shards == final.eval_shards
    today = evaluate_version(name, candidate.version, tmp_path / runs.HELDOUT_MANIFEST, tmp_path / "watch-eval.json")
    assert today.current_bits_per_byte == today.recorded_bits_per_byte == evaluation.bits_per_byte

    client.set_model_version_tag(name, candidate.version, "kiln.source.prose.weight", "0.9")
    edited = check_version(client.get_model_version(name, candidate.version), "sandbox")
    assert edited.status == "disagrees" and any("kiln.source.prose.weight" in str(m) for m in edited.mismatches)
    client.set_model_version_tag(name, candidate.version, "kiln.source.prose.weight", str(PROSE["weight"]))
    client.set_model_version_tag(name, candidate.version, "kiln.source.code.eval_bits_per_byte", "0.5")
    edited = check_version(client.get_model_version(name, candidate.version), "sandbox")
    assert edited.status == "disagrees"
    assert [m.record for m in edited.mismatches] == ["kiln.source.code.eval_bits_per_byte"], edited.mismatches


def test_a_source_that_breaches_its_gate_stops_the_run_naming_it(home: Path) -> None:
    strict = {**PROSE, "max_quarantine_share": 0.0}
    params = {"mixture": write_mixture(home, "strict", [CODE, strict]), "recipe": "tiny.toml"}
    pinned = stages.snapshot_run_stage(SANDBOX, params)
    assert isinstance(pinned, PinnedMixture)
    batches = validate_all(params, pinned)
    with pytest.raises(DataGateError, match=r"source 'prose' \(corpus prose, contract web-text@1\)"):
        stages.data_gate_run_stage(SANDBOX, params, pinned, batches, KEY)
    run = runs.run_dir(KEY)
    assert not (run / runs.TRAINING_MANIFEST).exists()
    # Every source's report is written, the breaching one's too: on-call needs it most now.
    assert (run / "sources" / "code" / runs.QUARANTINE_JSON).is_file()
    assert (run / "sources" / "prose" / runs.QUARANTINE_JSON).is_file()


@pytest.mark.parametrize(("source", "message"), [
    ({"name": "books", "corpus": "no-such-corpus", "weight": 1}, r"sources\[1\] \('books'\): corpus 'no-such-corpus' not found"),
    ({"name": "prose", "corpus": "code", "contract": "web-text@1", "weight": 1},
     r"sources\[1\] \('prose'\)(: |.*)contract 'web-text@1' does not fit corpus 'code'"),
], ids=["unknown-corpus", "contract-does-not-fit"])
def test_a_bad_source_is_refused_in_the_first_task_naming_it(home: Path, source: dict[str, Any], message: str) -> None:
    params = {"mixture": write_mixture(home, "bad", [{**CODE, "corpus": "prose", "contract": "web-text@1"}, source])}
    with pytest.raises(ConfigError, match=message):
        stages.snapshot_run_stage(SANDBOX, params)


def test_a_contract_asked_for_beside_a_mixture_is_refused(home: Path) -> None:
    params = {"mixture": write_mixture(home, "plain", [CODE, PROSE]), "contract": "web-text@1"}
    with pytest.raises(ConfigError, match="each source of a mixture is validated with its own contract"):
        stages.snapshot_run_stage(SANDBOX, params)
