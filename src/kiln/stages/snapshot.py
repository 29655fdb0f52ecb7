"""The snapshot stage: the corpus pinned as a DVC snapshot (or the announced one, checked)."""

from __future__ import annotations

from pathlib import Path

from kiln import settings as kiln_settings
from kiln.data.snapshot import CORPUS_NAME
from kiln.errors import ConfigError, SnapshotMismatchError
from kiln.policy import Policy
from kiln.refs import PinnedSnapshot


def snapshot_stage(policy: Policy, corpus: str | None = None, expected_ids: list[str] | None = None) -> PinnedSnapshot:
    """Snapshot the corpus with DVC and pin the run to an immutable, verified copy of those bytes.

    Production snapshots only its registered corpus; when the run was triggered by corpus asset
    events, the bytes found must be the ones those events announced, or the run fails (no retry).
    """
    name = corpus or policy.corpus
    if policy.pinned_inputs and name != policy.corpus:
        raise ConfigError(f"{policy.name} runs snapshot only the registered corpus {policy.corpus!r}, not {name!r}")
    return pin_corpus(name, expected_ids)


def pin_corpus(name: str, expected_ids: list[str] | None = None) -> PinnedSnapshot:
    """Snapshot corpus ``name`` and pin it (``snapshot_stage``, whichever policy asks: a mixture's
    sources are pinned by the mixture the run names)."""
    from kiln.data.snapshot import checkout_snapshot, create_snapshot
    from kiln.data.validation import TRAIN_GLOB, skipped_train_entries, train_shards

    if not CORPUS_NAME.fullmatch(name):
        raise ConfigError(f"corpus name {name!r} is not a valid corpus name ([a-z0-9][a-z0-9_.-]*)")
    s = kiln_settings.load()
    corpus_dir = s.corpus_root / name
    if not corpus_dir.is_dir():
        raise ConfigError(f"corpus {name!r} not found at {corpus_dir}; import it with `kiln corpus import SRC --name {name} "
                          f"--format ...` (or build the sample with `kiln corpus build --out {corpus_dir}`)")
    ref = create_snapshot(corpus_dir)
    if expected_ids and ref.id not in expected_ids:
        raise SnapshotMismatchError(
            f"run was triggered for corpus snapshot(s) {', '.join(expected_ids)} but the registered corpus "
            f"is now {ref.id}: refusing to train on other bytes than announced"
        )
    pinned = checkout_snapshot(ref.id)
    root = Path(pinned.path)
    # The shards `kiln validate` sees; anything else in train/ is named in the quarantine report.
    shards = [str(p.relative_to(root)) for p in train_shards(root)]
    if not shards:
        raise ConfigError(f"snapshot {ref.id} of corpus {name!r} has no training shards ({TRAIN_GLOB})")
    return PinnedSnapshot(**pinned.to_json(), shards=shards, skipped=[e.to_json() for e in skipped_train_entries(root)])
