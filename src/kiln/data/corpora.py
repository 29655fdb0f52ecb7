"""The corpora kiln knows: each corpus' own record (``corpus.json``) and the registry of them.

A kiln corpus is one directory, whoever wrote it (``kiln corpus import``, ``kiln corpus build``)::

    NAME/train/shard-NNNNN.parquet   training shards, one row per document: doc_id, text, source (strings)
    NAME/eval/eval-NNNNN.parquet     the held-out split: no document text of it is in train/
    NAME/corpus.json                 CorpusMetadata: what kind of text this is, the contract it was
                                     made for, where it came from, how it was split (written last)

``corpus.json`` travels inside every snapshot of the corpus, so a run reads the corpus' own record
from the bytes it is pinned to. It holds no time, no absolute path and not the name (the folder is
the name, as for ``kiln snapshot create``): the same input gives the same bytes, hence the same
snapshot id wherever it is written.

The registry is the corpus root of the settings (``Settings.corpus_root``, the DVC workspace's
``corpora/``): one folder per corpus name, where ``kiln snapshot create`` and the DAGs' snapshot task
find it. ``list_corpora`` is one directory listing plus one small JSON read per corpus, which is what
the sandbox trigger form costs when Airflow parses the DAG file (``form_choices``).

Which contracts fit which corpus: a corpus names its kind of text (``TEXT_KINDS``) and the contract
it was made for (``NAME@VERSION``); every version of that contract's family fits it, and so does every
family made for its kind of text (``KIND_FAMILIES``: web text and hard-wrapped prose are both
natural language; the stdlib sample is Python source, which the general source-code contract also
fits). Any other family is refused: its rules would quarantine the corpus for the wrong reasons.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln import settings as kiln_settings
from kiln.data.contracts import available_contracts, available_versions, contracts_dir, parse_contract_ref
from kiln.data.snapshot import CORPUS_NAME
from kiln.errors import ConfigError, ContractError, CorpusInputError
from kiln.util.fs import atomic_write_bytes, load_json

log = logging.getLogger("kiln.corpora")

METADATA_FILE = "corpus.json"
METADATA_FORMAT = 1
"""Version of the ``corpus.json`` layout; a reader refuses one it does not know."""
MAX_METADATA_BYTES = 1 << 20
"""A corpus record is a few hundred bytes of names and counts; a larger file is not one."""
TEXT_KINDS: dict[str, str] = {
    "python-source": "stdlib-py",
    "natural-language": "web-text",
    "source-code": "source-code",
}
"""Kind of text → the contract family made for it (the default contract of an import of that kind)."""
KIND_FAMILIES: dict[str, tuple[str, ...]] = {
    "python-source": ("stdlib-py", "source-code"),
    "natural-language": ("web-text", "prose-wrapped"),
    "source-code": ("source-code",),
}
"""Kind of text → every contract family made for it (the first is ``TEXT_KINDS``' default)."""
FORM_MAX_CORPORA = 200
"""The sandbox form lists at most this many corpora (by name); any other is still typed by hand."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitStats:
    """What one split of a corpus holds."""

    shards: int
    """Parquet files of the split."""
    documents: int
    """Rows (documents) over all its files."""
    text_bytes: int
    """UTF-8 bytes of the ``text`` column over all its rows."""

    def __post_init__(self) -> None:
        for name in ("shards", "documents", "text_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CorpusMetadata:
    """A corpus' own record, ``NAME/corpus.json``."""

    kind: str
    """Kind of text (a key of ``TEXT_KINDS``): which contracts fit it."""
    contract: str
    """``NAME@VERSION`` of the contract it was made for: what a run validates it against by default."""
    producer: str
    """What wrote it: ``kiln corpus import`` or ``kiln corpus build``."""
    source: dict[str, Any]
    """Where the documents came from: format, input name (never an absolute path), files read,
    the fields used. Free-form for the reader; nothing decides on it."""
    split: dict[str, Any]
    """How the held-out split was chosen (rule, seed, fraction)."""
    train: SplitStats
    eval: SplitStats

    def __post_init__(self) -> None:
        if self.kind not in TEXT_KINDS:
            raise ConfigError(f"kind must be one of {', '.join(TEXT_KINDS)}, got {self.kind!r}")
        try:
            _, version = parse_contract_ref(str(self.contract))
        except ContractError as exc:
            raise ConfigError(f"contract: {exc}") from None
        if version is None:
            raise ConfigError(f"contract must name a version (NAME@VERSION), got {self.contract!r}")

    @property
    def contract_family(self) -> str:
        return parse_contract_ref(self.contract)[0]

    def fits(self, contract: str) -> bool:
        """Whether ``contract`` (``NAME[@VERSION]``) is of the family this corpus was made for, or of a
        family made for its kind of text (``KIND_FAMILIES``)."""
        try:
            family = parse_contract_ref(contract)[0]
        except ContractError:
            return False
        return family == self.contract_family or family in KIND_FAMILIES.get(self.kind, ())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": METADATA_FORMAT, "kind": self.kind, "contract": self.contract,
            "producer": self.producer, "source": dict(self.source), "split": dict(self.split),
            "train": _stats_json(self.train), "eval": _stats_json(self.eval),
        }

    def to_bytes(self) -> bytes:
        """The file's bytes: sorted keys, so the same metadata is always the same bytes."""
        return (json.dumps(self.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: Any, where: str) -> CorpusMetadata:
        """Parse ``data`` read from ``where``; ``CorpusInputError`` naming ``where`` and the field."""
        if not isinstance(data, dict):
            raise CorpusInputError(f"{where}: corpus metadata must be a JSON object")
        if data.get("format") != METADATA_FORMAT:
            raise CorpusInputError(f"{where}: field 'format' is {data.get('format')!r}; this kiln reads {METADATA_FORMAT}")
        try:
            return cls(
                kind=data["kind"], contract=data["contract"], producer=str(data["producer"]),
                source=dict(data["source"]), split=dict(data["split"]),
                train=SplitStats(**data["train"]), eval=SplitStats(**data["eval"]),
            )
        except KeyError as exc:
            raise CorpusInputError(f"{where}: field {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError, ConfigError) as exc:
            raise CorpusInputError(f"{where}: {exc}") from None


def _stats_json(stats: SplitStats) -> dict[str, int]:
    return {"shards": stats.shards, "documents": stats.documents, "text_bytes": stats.text_bytes}


def default_contract(kind: str, contracts_root: Path | None = None) -> str:
    """The latest shipped version of the contract family made for ``kind``; ``ConfigError`` when none is."""
    if kind not in TEXT_KINDS:
        raise ConfigError(f"kind must be one of {', '.join(TEXT_KINDS)}, got {kind!r}")
    return pinned_contract(TEXT_KINDS[kind], contracts_root)


def pinned_contract(spec: str, contracts_root: Path | None = None) -> str:
    """``NAME@VERSION`` of an existing contract (no version: its latest); ``ConfigError`` naming what exists."""
    root = contracts_root or contracts_dir()
    try:
        name, version = parse_contract_ref(spec)
    except ContractError as exc:
        raise ConfigError(str(exc)) from None
    versions = available_versions(name, root)
    if not versions:
        known = ", ".join(available_contracts(root)) or "none"
        raise ConfigError(f"contract {name!r} is not shipped with this kiln (under {root}: {known})")
    if version is None:
        version = versions[-1]
    if version not in versions:
        raise ConfigError(f"contract {name!r} has no version {version} (known: {', '.join(map(str, versions))})")
    return f"{name}@{version}"


def metadata_path(corpus_dir: str | Path) -> Path:
    return Path(corpus_dir) / METADATA_FILE


def write_metadata(corpus_dir: str | Path, metadata: CorpusMetadata) -> Path:
    return atomic_write_bytes(metadata_path(corpus_dir), metadata.to_bytes())


def read_metadata(corpus_dir: str | Path) -> CorpusMetadata | None:
    """The corpus' record; None for a corpus without one (written before records existed).

    ``CorpusInputError`` naming the file for one that cannot be read or parsed."""
    path = metadata_path(corpus_dir)
    if not os.path.lexists(path):
        return None
    try:
        data = load_json(path, "corpus record", CorpusInputError, max_bytes=MAX_METADATA_BYTES, follow_link=False)
    except CorpusInputError as exc:
        raise CorpusInputError(f"{path}: not a JSON corpus record: {str(exc).removeprefix(f'{path}: ')}") from None
    return CorpusMetadata.from_json(data, str(path))


@dataclass(frozen=True, kw_only=True, slots=True)
class CorpusEntry:
    """One corpus of the registry."""

    name: str
    path: Path
    metadata: CorpusMetadata | None
    """None: no ``corpus.json`` (an older corpus), or ``problem`` says why it could not be read."""
    problem: str | None = None

    def label(self) -> str:
        """One line for a person choosing it (the sandbox form's label)."""
        if self.problem:
            return f"{self.name} (unreadable corpus.json)"
        meta = self.metadata
        if meta is None:
            return f"{self.name} (no corpus.json)"
        return (f"{self.name} — {meta.kind}, contract {meta.contract}, {meta.train.documents:,} training "
                f"documents in {meta.train.shards} shard(s)")


def corpus_root() -> Path:
    return kiln_settings.load().corpus_root


def list_corpora(root: Path | None = None) -> list[CorpusEntry]:
    """Every corpus folder under the corpus root (names in ``CORPUS_NAME`` form, hidden staging
    folders of a running import left out), sorted by name. Never raises for one bad corpus: its
    entry says what is wrong."""
    base = root or corpus_root()
    try:
        names = sorted(e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False) and CORPUS_NAME.fullmatch(e.name))
    except OSError:
        return []
    entries = []
    for name in names:
        path = base / name
        try:
            entries.append(CorpusEntry(name=name, path=path, metadata=read_metadata(path)))
        except CorpusInputError as exc:
            entries.append(CorpusEntry(name=name, path=path, metadata=None, problem=str(exc)))
    return entries


def contract_refs(contracts_root: Path | None = None) -> list[str]:
    """``NAME@VERSION`` of every shipped contract (a listing of ``data_contracts/``, no JSON read)."""
    root = contracts_root or contracts_dir()
    return [f"{name}@{v}" for name in available_contracts(root) for v in available_versions(name, root)]


@dataclass(frozen=True, kw_only=True, slots=True)
class FormChoices:
    """What the sandbox trigger form offers (``kiln.airflow.dagfactory``)."""

    corpora: list[str]
    corpus_labels: dict[str, str]
    contracts: list[str | None]
    """``None`` (the corpus' own contract) first, then every shipped ``NAME@VERSION``."""
    contract_labels: dict[str, str]


RUN_CORPUS_CONTRACT = None
"""The run parameter ``contract`` that means: the contract the corpus' ``corpus.json`` names (the
form's empty choice, ``null`` in a REST conf). Not ``""``: the Airflow UI takes an empty string in a
select for a missing value and will not submit the form."""


def form_choices(default_corpus: str, root: Path | None = None, contracts_root: Path | None = None) -> FormChoices:
    """The corpora of the registry (``default_corpus`` always among them) and the shipped contracts,
    each labelled with the corpora it fits. Cheap enough for a DAG parse: a listing of the corpus
    root, one small JSON read per corpus, a listing of ``data_contracts/``. Never raises."""
    entries = list_corpora(root)[:FORM_MAX_CORPORA]
    labels = {e.name: e.label() for e in entries}
    labels.setdefault(default_corpus, f"{default_corpus} (not built yet)")
    try:
        refs = contract_refs(contracts_root)
    except OSError:
        refs = []
    contract_labels: dict[str, str] = {}
    for ref in refs:
        fitting = [e.name for e in entries if e.metadata is not None and e.metadata.fits(ref)]
        contract_labels[ref] = f"{ref} — fits {', '.join(fitting)}" if fitting else f"{ref} — fits no corpus built yet"
    return FormChoices(corpora=sorted(labels), corpus_labels=labels, contracts=[RUN_CORPUS_CONTRACT, *refs],
                       contract_labels=contract_labels)


def run_contract(requested: str | None, metadata: CorpusMetadata | None, fallback: str, *, corpus: str,
                 pinned: bool = False) -> str:
    """The contract a run validates ``corpus`` against.

    ``requested`` is the run's own choice (``""``/None: none). A pinned policy (production) takes only
    ``fallback``, its reviewed contract, and refuses a corpus whose record says it was made for
    another family. Otherwise: the requested contract, else the corpus' own, else ``fallback`` for a
    corpus without a record. A contract that does not fit the corpus (``CorpusMetadata.fits``: neither
    its own family nor one made for its kind of text) is refused (``ConfigError`` naming both and the
    families that fit): its rules would quarantine every shard for the wrong reasons.
    """
    chosen = (requested or "").strip()
    if pinned:
        if chosen and chosen != fallback:
            raise ConfigError(f"contract {chosen!r} asked for, but this policy validates only with {fallback!r}")
        chosen = fallback
    elif not chosen:
        chosen = metadata.contract if metadata is not None else fallback
    if metadata is not None and not metadata.fits(chosen):
        fitting = sorted({metadata.contract_family, *KIND_FAMILIES.get(metadata.kind, ())})
        raise ConfigError(
            f"contract {chosen!r} does not fit corpus {corpus!r}: its corpus.json says it is {metadata.kind} text, "
            f"made for {metadata.contract} (family {metadata.contract_family!r}; families that fit: {', '.join(fitting)})"
        )
    return chosen
