"""``kiln.data.validation.data_gate``: the gate's threshold and refusals, the TrainingManifest of the healthy shards."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kiln.data.validation import build_training_manifest, gate
from kiln.errors import ContractError, DataGateError, ManifestError
from kiln.refs import TrainingManifest, sha256_file

from shard_fixtures import fake_report


def test_gate_passes_at_or_below_the_threshold() -> None:
    reports = [fake_report(f"s{i}") for i in range(3)] + [fake_report("s3", "quarantined")]
    gate(reports, 0.25)
    gate(reports, 0.5)


def test_gate_fails_above_the_threshold_naming_shards_and_share() -> None:
    reports = [fake_report("s0"), fake_report("bad-1", "quarantined"), fake_report("bad-2", "quarantined")]
    with pytest.raises(DataGateError,
                       match=r"2/3 shards quarantined \(66\.7%\) exceeds the maximum 50\.0%: bad-1, bad-2") as info:
        gate(reports, 0.5)
    assert info.value.retryable is False


@pytest.mark.parametrize(
    "reports, kwargs, message",
    [
        ([], {}, "no shards were validated"),
        ([fake_report("bad", "quarantined")], {}, "no healthy shard"),
        ([fake_report("s0")], {"expected_paths": ["/c/train/s0", "/c/train/s1"]}, "never validated: s1"),
    ],
)
def test_gate_fails_without_healthy_or_unvalidated_shards(reports, kwargs, message) -> None:
    with pytest.raises(DataGateError, match=message):
        gate(reports, 1.0, **kwargs)


def test_gate_rejects_a_bad_threshold() -> None:
    with pytest.raises(DataGateError, match="within"):
        gate([fake_report("s0")], 1.5)


def test_manifest_lists_only_healthy_shards_and_verifies(poisoned_corpus, poisoned_reports, stdlib_contract,
                                                         tmp_path: Path) -> None:
    eval_path = poisoned_corpus["eval"][0]
    manifest = build_training_manifest("d" * 32 + ".dir", "stdlib-py", stdlib_contract, poisoned_reports, [eval_path])
    healthy = sorted(r.path for r in poisoned_reports if r.verdict == "healthy")
    assert [s["path"] for s in manifest.shards] == healthy
    assert sorted(manifest.quarantined) == sorted(r.path for r in poisoned_reports if r.verdict == "quarantined")
    for entry in manifest.shards:
        assert entry["sha256"] == sha256_file(entry["path"]) and entry["rows"] == pq.read_metadata(entry["path"]).num_rows
    eval_rows = poisoned_corpus["documents"]["eval"]
    assert manifest.eval_shards == [{"path": eval_path, "sha256": sha256_file(eval_path), "rows": eval_rows}]
    assert manifest.contract == "stdlib-py@1" and manifest.sha256 == manifest.content_hash()
    path = manifest.write(tmp_path / "manifest.json")
    assert TrainingManifest.read(path) == manifest
    tampered = json.loads(path.read_text())
    tampered["shards"].append(tampered["shards"][0])
    path.write_text(json.dumps(tampered))
    with pytest.raises(ManifestError):
        TrainingManifest.read(path)


def test_manifest_refuses_reports_of_another_contract_version() -> None:
    with pytest.raises(ContractError, match="stdlib-py@2"):
        build_training_manifest("x.dir", "stdlib-py", "stdlib-py@1", [fake_report("a"), fake_report("b", contract="stdlib-py@2")])


def test_a_listed_shard_is_read_only_as_a_regular_file_where_it_is(poisoned_corpus, poisoned_reports, stdlib_contract,
                                                                    tmp_path: Path) -> None:
    import os

    link = tmp_path / "eval-00000.parquet"
    link.symlink_to(poisoned_corpus["eval"][0])
    with pytest.raises(ContractError, match=f"shard {link} cannot be listed in the TrainingManifest: .*symlink"):
        build_training_manifest("d" * 32 + ".dir", "stdlib-py", stdlib_contract, poisoned_reports, [link])
    link.unlink()
    os.mkfifo(link)
    with pytest.raises(ContractError, match="FIFO, not a regular file"):
        build_training_manifest("d" * 32 + ".dir", "stdlib-py", stdlib_contract, poisoned_reports, [link])
