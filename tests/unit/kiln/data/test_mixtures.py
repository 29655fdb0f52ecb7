"""A data mixture is configuration: what the file alone can get wrong is refused when it is read,
naming the file and the field (``MixtureError``); every shipped mixture reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.data.mixtures import available_mixtures, load_mixture, parse_mixture
from kiln.errors import ConfigError, MixtureError

GOOD = {"description": "test", "sources": [
    {"name": "code", "corpus": "stdlib-py", "contract": "stdlib-py@1", "weight": 3},
    {"name": "prose", "corpus": "prose", "weight": 1, "max_quarantine_share": 0.1},
]}


def with_source(i: int, **change: Any) -> dict[str, Any]:
    sources = [dict(s) for s in GOOD["sources"]]
    sources[i] = {k: v for k, v in {**sources[i], **change}.items() if v is not None}
    return {**GOOD, "sources": sources}


def test_a_mixture_reads_with_its_shares_in_declared_order() -> None:
    mixture = parse_mixture(GOOD, name="mix", origin="mix.toml")
    assert [s.name for s in mixture.sources] == ["code", "prose"]
    assert mixture.shares() == {"code": 0.75, "prose": 0.25}
    assert mixture.sources[0].contract == "stdlib-py@1" and mixture.sources[1].contract is None
    assert mixture.sources[1].max_quarantine_share == 0.1 and mixture.sources[0].max_quarantine_share is None
    again = {"description": "test", "sources": [s.to_json() for s in mixture.sources]}
    assert parse_mixture(again, name="mix", origin="mix.toml") == mixture


def test_caps_and_on_exhausted_read_and_resolve_to_the_manifests_limits() -> None:
    plain = parse_mixture(GOOD, name="mix", origin="mix.toml")
    assert plain.on_exhausted == "recycle" and [plain.resolved_limits(s) for s in plain.sources] == [{}, {}]
    capped = parse_mixture(with_source(1, max_epochs=2), name="mix", origin="mix.toml")
    assert capped.sources[1].max_epochs == 2 and capped.sources[1].max_tokens is None
    assert [capped.resolved_limits(s) for s in capped.sources] == [{}, {"max_epochs": 2}]
    stop = parse_mixture({**with_source(0, max_tokens=10_000), "on_exhausted": "stop"}, name="mix", origin="mix.toml")
    # "stop": a source without a cap of its own stops the run at the end of its first epoch.
    assert [stop.resolved_limits(s) for s in stop.sources] == [{"max_tokens": 10_000}, {"max_epochs": 1}]
    both = parse_mixture(with_source(0, max_tokens=7, max_epochs=3), name="mix", origin="mix.toml")
    assert both.resolved_limits(both.sources[0]) == {"max_epochs": 3, "max_tokens": 7}
    for mixture in (capped, stop, both):  # to_json reads back as the same mixture
        again = {k: v for k, v in mixture.to_json().items() if k != "name"}
        assert parse_mixture(again, name="mix", origin="mix.toml") == mixture
    assert "on_exhausted" not in plain.to_json() and stop.to_json()["on_exhausted"] == "stop"


@pytest.mark.parametrize(("data", "message"), [
    (with_source(1, weight=0), r"sources\[1\] \('prose'\)\.weight = 0: must be a finite number > 0"),
    (with_source(1, weight=-2.5), r"sources\[1\] \('prose'\)\.weight = -2\.5"),
    (with_source(0, weight=float("nan")), r"sources\[0\] \('code'\)\.weight = nan"),
    (with_source(0, weight=True), r"sources\[0\] \('code'\)\.weight = True"),
    (with_source(0, weight=None), r"sources\[0\] \('code'\)\.weight = None"),
    (with_source(1, name="Prose!"), r"sources\[1\]\.name = 'Prose!': must be 1-64 characters"),
    (with_source(1, name="code"), r"sources\[1\] \('code'\)\.name: same name"),
    ({"sources": [{"name": "a-b", "corpus": "x", "weight": 1}, {"name": "a_b", "corpus": "y", "weight": 1}]},
     r"sources\[1\] \('a_b'\)\.name: same name \(or metric name 'a_b'\) as sources\[0\]"),
    (with_source(1, corpus="stdlib-py"), r"sources\[1\] \('prose'\)\.corpus = 'stdlib-py': sources\[0\] \('code'\) reads it"),
    (with_source(1, corpus="../etc"), r"sources\[1\] \('prose'\)\.corpus = '\.\./etc': must be a corpus name"),
    (with_source(0, contract="stdlib-py"), r"sources\[0\] \('code'\)\.contract = 'stdlib-py': must be NAME@VERSION"),
    (with_source(0, contract="no-such@1"), r"sources\[0\] \('code'\)\.contract = 'no-such@1': .*no-such"),
    (with_source(1, max_quarantine_share=1.5), r"sources\[1\] \('prose'\)\.max_quarantine_share = 1\.5"),
    (with_source(1, wieght=2), r"sources\[1\] \('prose'\): unknown key\(s\) wieght"),
    ({**GOOD, "sources": []}, r"'sources' must be a non-empty array"),
    ({"sources": GOOD["sources"], "weights": {}}, r"unknown key\(s\) weights"),
    ({**GOOD, "sources": [1]}, r"sources\[0\] must be a table"),
    (with_source(1, max_epochs=0), r"sources\[1\] \('prose'\)\.max_epochs = 0: must be a whole number of epochs >= 1"),
    (with_source(1, max_epochs=1.5), r"sources\[1\] \('prose'\)\.max_epochs = 1\.5: must be a whole number"),
    (with_source(0, max_epochs=True), r"sources\[0\] \('code'\)\.max_epochs = True"),
    (with_source(0, max_tokens=-5), r"sources\[0\] \('code'\)\.max_tokens = -5: must be a whole number of tokens >= 1"),
    (with_source(0, max_tokens="1e9"), r"sources\[0\] \('code'\)\.max_tokens = '1e9'"),
    (with_source(0, max_epoch=2), r"sources\[0\] \('code'\): unknown key\(s\) max_epoch"),
    ({**GOOD, "on_exhausted": "halt"}, r"on_exhausted = 'halt': must be one of 'recycle', 'stop'"),
    ({**GOOD, "on_exhausted": 1}, r"on_exhausted = 1: must be one of"),
], ids=["weight-zero", "weight-negative", "weight-nan", "weight-bool", "weight-missing", "bad-name", "duplicate-name",
        "same-metric-name", "corpus-twice", "corpus-path", "contract-unpinned", "contract-unknown", "share-above-1",
        "unknown-source-key", "no-sources", "unknown-key", "source-not-table", "max-epochs-zero", "max-epochs-float",
        "max-epochs-bool", "max-tokens-negative", "max-tokens-string", "cap-typo", "on-exhausted-unknown",
        "on-exhausted-not-string"])
def test_a_bad_mixture_is_refused_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(MixtureError, match=message) as caught:
        parse_mixture(data, name="mix", origin="training/mixtures/mix.toml")
    assert "mixture 'mix' (training/mixtures/mix.toml)" in str(caught.value)
    assert isinstance(caught.value, ConfigError) and not caught.value.retryable


def test_a_mixture_file_that_is_missing_or_not_toml_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "broken.toml").write_text("[[sources]\nname = ")
    with pytest.raises(MixtureError, match=r"mixture 'broken': cannot read .*broken\.toml"):
        load_mixture("broken", tmp_path)
    with pytest.raises(MixtureError, match=r"mixture 'absent' not found: no .*absent\.toml \(mixtures: broken\)"):
        load_mixture("absent", tmp_path)
    with pytest.raises(MixtureError, match="not a mixture name"):
        load_mixture("../config/production", tmp_path)


def test_every_shipped_mixture_reads() -> None:
    names = available_mixtures()
    assert "code-and-prose" in names
    for name in names:
        mixture = load_mixture(name)
        assert mixture.name == name and len(mixture.sources) >= 2 and abs(sum(mixture.shares().values()) - 1) < 1e-9
