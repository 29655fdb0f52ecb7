"""Data mixtures as configuration: a run that trains on several corpora, each under its own contract,
mixed by declared weights.

A mixture is a TOML file under ``training/mixtures/`` (shipped with kiln like the recipes; its file
name is its name), or production's ``[mixture]`` table in the reviewed ``config/production.toml``::

    description = "Python code and documentation prose"
    on_exhausted = "recycle"    # optional: "recycle" (the default) or "stop"; before the first [[sources]]

    [[sources]]
    name = "code"               # the source's name: keys its metrics, tags and shares (a-z 0-9 _ . -)
    corpus = "stdlib-py"        # a corpus under the corpus root (`kiln corpus list`)
    contract = "stdlib-py@1"    # optional: NAME@VERSION; absent, the one the corpus' corpus.json names
    weight = 0.7                # > 0: the source's share is its weight over the sum of the weights
    max_quarantine_share = 0.25 # optional: this source's gate; absent, the policy's
    max_epochs = 3              # optional cap: the run stops before a 4th pass over this source

    [[sources]]
    name = "docs"
    corpus = "python-docs"
    weight = 0.3
    max_tokens = 50_000_000     # optional budget: the run stops before this source gives more tokens

A source that runs out of samples starts a new epoch of its own order (``on_exhausted = "recycle"``);
with ``on_exhausted = "stop"`` a source without a cap of its own is capped at one epoch. A cap (its
``max_epochs`` or ``max_tokens``) ends the run: the draw follows the weights position by position, so a
source cannot leave it mid-run without moving every later sample; the trainer stops before the first
step that would draw a capped source past its cap, commits a checkpoint there and says so in its
result. ``resolved_limits`` gives each source's cap as the training manifest carries it.

A run of a mixture snapshots each source, validates each against its own contract, gates each by its
own threshold, packs every source with the run's one tokenizer, and trains on the draw
``kiln_trainer.mixture`` makes of them: a function of the seed, the step and the weights only.

What can be checked from the file alone is checked when it is read (``MixtureError``, a ``ConfigError``
naming the file and the field): names, weights, unknown keys, a corpus named twice, a contract that
does not exist. What needs the corpora (a corpus that is not there, a contract that does not fit its
corpus, a source with no healthy shard) is refused by the run's first tasks, naming the source.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.data.snapshot import CORPUS_NAME
from kiln.errors import ContractError, MixtureError
from kiln.shipped import MIXTURES_DIR
from kiln_trainer.contract.training_manifest import SOURCE_NAME, metric_name

MIXTURE_NAME = CORPUS_NAME
"""A mixture's name (its file's stem): a corpus name's alphabet."""
MAX_SOURCES = 64
"""A mixture's sources, at most: each one is mapped tasks and a tag set on every version."""
_SOURCE_KEYS = frozenset({"name", "corpus", "contract", "weight", "max_quarantine_share", "max_epochs", "max_tokens"})
_MIXTURE_KEYS = frozenset({"description", "sources", "on_exhausted"})
ON_EXHAUSTED = ("recycle", "stop")
"""What a source without a cap of its own does when it runs out: start a new epoch, or stop the run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MixtureSource:
    """One source of a mixture, as declared."""

    name: str
    corpus: str
    contract: str | None
    """``NAME@VERSION``; None: the contract the corpus' ``corpus.json`` names."""
    weight: float
    max_quarantine_share: float | None = None
    """This source's data gate; None: the policy's ``max_quarantine_share``."""
    max_epochs: int | None = None
    """Cap: the run stops before this source's ``max_epochs + 1``-th epoch; None: no epoch cap."""
    max_tokens: int | None = None
    """Budget: the run stops before this source gives more than ``max_tokens`` tokens; None: none."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "corpus": self.corpus, "weight": self.weight}
        for key in ("contract", "max_quarantine_share", "max_epochs", "max_tokens"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        return data


@dataclass(frozen=True, kw_only=True, slots=True)
class Mixture:
    """A mixture, as declared: its name, where it was declared, and its sources in declared order."""

    name: str
    sources: tuple[MixtureSource, ...]
    origin: str
    """Where it was declared (a file, or ``config/production.toml [mixture]``), for messages."""
    description: str = ""
    on_exhausted: str = "recycle"
    """``ON_EXHAUSTED``: "stop" caps every source without a cap of its own at one epoch."""

    def resolved_limits(self, source: MixtureSource) -> dict[str, int]:
        """The source's caps as its training manifest entry carries them (``max_epochs``, ``max_tokens``;
        none: it recycles): its own, or one epoch where the mixture says ``on_exhausted = "stop"``."""
        limits = {key: value for key in ("max_epochs", "max_tokens") if (value := getattr(source, key)) is not None}
        if not limits and self.on_exhausted == "stop":
            limits["max_epochs"] = 1
        return limits

    def source(self, name: str) -> MixtureSource:
        for s in self.sources:
            if s.name == name:
                return s
        raise MixtureError(f"mixture {self.name!r} ({self.origin}) has no source {name!r}; its sources are "
                           f"{', '.join(s.name for s in self.sources)}")

    def shares(self) -> dict[str, float]:
        """Each source's declared share: its weight over the sum of the weights."""
        total = sum(s.weight for s in self.sources)
        return {s.name: s.weight / total for s in self.sources}

    def to_json(self) -> dict[str, Any]:
        data = {"name": self.name, "description": self.description, "sources": [s.to_json() for s in self.sources]}
        if self.on_exhausted != "recycle":
            data["on_exhausted"] = self.on_exhausted
        return data


def parse_mixture(data: Any, *, name: str, origin: str) -> Mixture:
    """The mixture ``data`` (a parsed TOML table) declares; ``MixtureError`` naming ``origin`` and the field."""
    from kiln.data.contracts import load_contract

    def fail(message: str) -> MixtureError:
        return MixtureError(f"mixture {name!r} ({origin}): {message}")

    if not MIXTURE_NAME.fullmatch(name):
        raise fail(f"{name!r} is not a mixture name ([a-z0-9][a-z0-9_.-]*)")
    if not isinstance(data, dict):
        raise fail(f"must be a table, got {type(data).__name__}")
    unknown = sorted(set(data) - _MIXTURE_KEYS)
    if unknown:
        raise fail(f"unknown key(s) {', '.join(unknown)}; a mixture has {', '.join(map(repr, sorted(_MIXTURE_KEYS)))}")
    on_exhausted = data.get("on_exhausted", "recycle")
    if on_exhausted not in ON_EXHAUSTED:
        raise fail(f"on_exhausted = {on_exhausted!r:.40}: must be one of {', '.join(map(repr, ON_EXHAUSTED))} (what a "
                   "source without max_epochs or max_tokens does when it runs out)")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise fail(f"description must be a string, got {type(description).__name__}")
    raw = data.get("sources")
    if not isinstance(raw, list) or not raw:
        raise fail("'sources' must be a non-empty array of tables ([[sources]])")
    if len(raw) > MAX_SOURCES:
        raise fail(f"{len(raw)} sources; at most {MAX_SOURCES}")
    sources: list[MixtureSource] = []
    for i, item in enumerate(raw):
        at = f"sources[{i}]"
        if not isinstance(item, dict):
            raise fail(f"{at} must be a table, got {type(item).__name__}")
        label = f"{at} ({item.get('name')!r})" if isinstance(item.get("name"), str) else at
        unknown = sorted(set(item) - _SOURCE_KEYS)
        if unknown:
            raise fail(f"{label}: unknown key(s) {', '.join(unknown)}; a source has {', '.join(sorted(_SOURCE_KEYS))}")
        source_name = item.get("name")
        if not isinstance(source_name, str) or not SOURCE_NAME.fullmatch(source_name):
            raise fail(f"{at}.name = {source_name!r:.80}: must be 1-64 characters of a-z, 0-9, '_', '.' and '-', "
                       "starting with a letter or digit")
        corpus = item.get("corpus")
        if not isinstance(corpus, str) or not CORPUS_NAME.fullmatch(corpus):
            raise fail(f"{label}.corpus = {corpus!r:.80}: must be a corpus name under the corpus root "
                       "([a-z0-9][a-z0-9_.-]*, `kiln corpus list`)")
        weight = item.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise fail(f"{label}.weight = {weight!r:.40}: must be a finite number > 0")
        contract = item.get("contract")
        if contract is not None:
            if not isinstance(contract, str) or "@" not in contract:
                raise fail(f"{label}.contract = {contract!r:.80}: must be NAME@VERSION (a pinned contract version)")
            try:
                load_contract(contract)
            except ContractError as exc:
                raise fail(f"{label}.contract = {contract!r}: {exc}") from exc
        share = item.get("max_quarantine_share")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1):
            raise fail(f"{label}.max_quarantine_share = {share!r:.40}: must be a number in [0, 1]")
        limits: dict[str, int] = {}
        for key, what in (("max_epochs", "epochs"), ("max_tokens", "tokens")):
            value = item.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise fail(f"{label}.{key} = {value!r:.40}: must be a whole number of {what} >= 1")
                limits[key] = value
        for j, other in enumerate(sources):
            if other.name == source_name or metric_name(other.name) == metric_name(source_name):
                raise fail(f"{label}.name: same name (or metric name {metric_name(source_name)!r}) as sources[{j}]")
            if other.corpus == corpus:
                raise fail(f"{label}.corpus = {corpus!r}: sources[{j}] ({other.name!r}) reads it already; a corpus "
                           "is one source (give it more weight instead)")
        sources.append(MixtureSource(name=source_name, corpus=corpus, contract=contract, weight=float(weight),
                                     max_quarantine_share=None if share is None else float(share), **limits))
    return Mixture(name=name, sources=tuple(sources), origin=origin, description=description, on_exhausted=on_exhausted)


def mixtures_dir() -> Path:
    """Where the shipped mixtures are: ``training/mixtures/``."""
    return MIXTURES_DIR


def available_mixtures(root: Path | None = None) -> list[str]:
    """The names of the mixtures under ``root`` (default ``training/mixtures/``), sorted. Never raises."""
    folder = root or mixtures_dir()
    try:
        return sorted(p.stem for p in folder.glob("*.toml") if MIXTURE_NAME.fullmatch(p.stem))
    except OSError:
        return []


def load_mixture(name: str, root: Path | None = None) -> Mixture:
    """The mixture ``training/mixtures/<name>.toml`` (or under ``root``), checked."""
    folder = root or mixtures_dir()
    if not isinstance(name, str) or not MIXTURE_NAME.fullmatch(name):
        raise MixtureError(f"mixture {name!r:.80}: not a mixture name ([a-z0-9][a-z0-9_.-]*)")
    path = folder / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(available_mixtures(folder)) or "none"
        raise MixtureError(f"mixture {name!r} not found: no {path} (mixtures: {known})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise MixtureError(f"mixture {name!r}: cannot read {path}: {exc}") from exc
    return parse_mixture(data, name=name, origin=str(path))
