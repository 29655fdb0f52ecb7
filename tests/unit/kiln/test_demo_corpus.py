"""``kiln demo --corpus`` up to the trigger (the stack part is the sandbox DAG's e2e test): the
prose corpus is built and imported the same way twice, the sandbox form takes the run it triggers,
and its shards pass the contract its corpus.json names (web-text where shipped, else stdlib-py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kiln.errors import DemoError
from kiln.policy import SANDBOX


def _files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_prose_demo_corpus_is_imported_and_passes_the_contract_its_record_names(home):
    from kiln.airflow.dagfactory import build_dag
    from kiln.data.corpora import read_metadata
    from kiln.data.validation import validate_directory
    from kiln.stack.demo import PROSE_CORPUS, demo_corpus, sandbox_conf
    from kiln.stages import check_run_conf, run_policy, snapshot_stage

    corpus = demo_corpus(PROSE_CORPUS)
    first = _files(Path(corpus["out"]))
    assert len([f for f in first if f.startswith("train/")]) >= 3 and corpus["eval"]["documents"] > 5
    assert _files(Path(demo_corpus(PROSE_CORPUS)["out"])) == first, "a second demo imports the same bytes"
    meta = read_metadata(corpus["out"])
    assert meta is not None and meta.kind == "natural-language" and meta.contract == corpus["contract"]
    assert bool(corpus["note"]) == (not meta.contract.startswith("web-text@"))

    conf = sandbox_conf(PROSE_CORPUS)
    params = build_dag(SANDBOX).params
    for key, value in conf.items():
        params.get_param(key).resolve(value)  # the form takes it
    check_run_conf(SANDBOX, conf, set(params.keys()))
    pinned = snapshot_stage(SANDBOX, conf["corpus"])
    policy = run_policy(SANDBOX, conf, pinned)
    assert policy.contract == meta.contract
    reports = validate_directory(pinned.path, policy.contract)
    quarantined = [r.reasons for r in reports if r.verdict != "healthy"]
    # Nothing in the sample is bad: no shard is quarantined, under web-text (documents dropped by its
    # rules, each shard well under max_dropped_share) or the stdlib contract.
    assert reports and quarantined == []


def test_a_demo_corpus_that_does_not_exist_says_how_to_make_it(home):
    from kiln.stack.demo import demo_corpus

    with pytest.raises(DemoError, match=r"corpus 'nope' not found at .*kiln corpus import SRC --name nope"):
        demo_corpus("nope")


def test_the_mixture_demo_prepares_each_sources_corpus_and_the_form_takes_its_run(home, monkeypatch, tmp_path):
    """``kiln demo --mixture code-and-prose`` up to the trigger: both corpora built (the stdlib sample
    and the prose import), the run it triggers taken by the sandbox form, and its first task pins both
    sources under their own contracts. A source whose corpus kiln cannot build is refused naming it."""
    from kiln.airflow.dagfactory import build_dag
    from kiln.data import mixtures
    from kiln.errors import MixtureError
    from kiln.refs import PinnedMixture
    from kiln.stack.demo import demo_mixture, mixture_conf, run_demo
    from kiln.stages import check_run_conf, snapshot_run_stage

    prepared = demo_mixture("code-and-prose")
    assert set(prepared["prepared"]) == {"code", "prose"}
    conf = mixture_conf("code-and-prose")
    params = build_dag(SANDBOX).params
    for key, value in conf.items():
        params.get_param(key).resolve(value)  # the form takes it
    check_run_conf(SANDBOX, conf, set(params.keys()))
    pinned = snapshot_run_stage(SANDBOX, {**conf, "corpus": SANDBOX.corpus})
    assert isinstance(pinned, PinnedMixture) and [s.snapshot.corpus for s in pinned.sources] == ["stdlib-py", "prose"]

    folder = tmp_path / "mixtures"
    folder.mkdir()
    (folder / "elsewhere.toml").write_text('[[sources]]\nname = "books"\ncorpus = "books"\nweight = 1\n')
    monkeypatch.setattr(mixtures, "mixtures_dir", lambda: folder)
    with pytest.raises(DemoError, match=r"source 'books': corpus 'books' not found .*kiln corpus import SRC --name books"):
        demo_mixture("elsewhere")
    with pytest.raises(MixtureError, match="mixture 'nope' not found"):
        demo_mixture("nope")
    with pytest.raises(DemoError, match="one corpus .* or one mixture"):
        run_demo("prose", "code-and-prose")
