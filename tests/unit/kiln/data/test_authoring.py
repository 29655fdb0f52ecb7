"""``kiln contract init|check`` (``kiln.data.authoring``): a draft profiled from a corpus that validates
its own sample, never an overwrite, and every bad field of a contract named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.data.contracts import CONTRACTS_DIR, load_contract
from kiln.data.validation import validate_directory

from webtext_fixtures import prose_documents, split, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("authoring") / "corpus"
    write_corpus(out, split(prose_documents()[:150], 3))
    return out


def test_init_writes_a_reviewable_draft_that_passes_its_own_sample_and_never_overwrites(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "draft.json"
    assert main(["contract", "init", "my-prose", "--from", str(corpus), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents_profiled"] == 150 and summary["shards_profiled"] == 3
    assert set(summary["document_rules_would_drop"]["by_rule"]) <= {r["rule"] for r in load_contract("web-text@1").document_rules}
    suite = json.loads(out.read_text())
    assert suite["name"] == "my-prose" and suite["notes"].startswith("DRAFT") and suite["meta"]["kiln"]["version"] == 1
    profile = suite["meta"]["kiln_profile"]
    length = next(e for e in suite["expectations"] if e["meta"]["kiln_rule"] == "text_length")["kwargs"]
    lengths = [len(t) for _, t, _ in prose_documents()[:150]]
    assert length["min_value"] <= min(lengths) and length["max_value"] >= max(lengths)
    assert profile["text_chars"]["0.5"] == sorted(lengths)[74]
    # Published under its name, it loads and its own sample passes it.
    root = tmp_path / "contracts"
    shutil.copytree(CONTRACTS_DIR, root)
    (root / "my-prose").mkdir()
    shutil.copy(out, root / "my-prose" / "v1.json")
    contract = load_contract("my-prose@1", root)
    assert all(r.verdict == "healthy" for r in validate_directory(corpus, contract))
    before = out.read_bytes()
    assert main(["contract", "init", "my-prose", "--from", str(corpus), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["Bad Name", "--from", "{corpus}"], "contract name 'Bad Name'"),
        (["x", "--from", "{corpus}/train"], "has no training shards"),
        (["x", "--from", "{corpus}/nope"], "not a directory"),
        (["x", "--from", "{corpus}", "--base", "no-such@1"], "--base no-such@1: unknown contract"),
        (["x", "--from", "{corpus}", "--text-column", "body"], "--text-column 'body' is not a column"),
    ],
)
def test_init_usage_errors_name_the_bad_argument(corpus: Path, tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    args = [a.replace("{corpus}", str(corpus)) for a in argv]
    assert main(["contract", "init", *args, "--out", str(tmp_path / "d.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d.json").exists()


def test_check_passes_the_shipped_contracts(capsys) -> None:
    for path in (CONTRACTS_DIR / "web-text" / "v1.json", CONTRACTS_DIR / "stdlib-py" / "v1.json"):
        assert main(["contract", "check", str(path)]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["ok"] is True


def test_check_names_every_bad_field(tmp_path: Path, capsys) -> None:
    suite = json.loads((CONTRACTS_DIR / "web-text" / "v1.json").read_text())
    suite["expectations"].append({"type": "expect_vibes", "kwargs": {}})
    suite["expectations"].append({"type": "expect_column_values_to_be_between", "kwargs": {"column": "text", "mostly": 7}})
    suite["meta"]["kiln"]["document_rules"][3]["params"]["min_doc_words"] = "many"
    suite["meta"]["kiln"]["near_duplicates"]["num_perm"] = 1
    suite["meta"]["kiln"]["max_dropped_share"] = -1
    path = tmp_path / "web-text" / "v2.json"
    path.parent.mkdir()
    path.write_text(json.dumps(suite))
    assert main(["contract", "check", str(path)]) == 1
    captured = capsys.readouterr()
    problems = json.loads(captured.out)["problems"]
    expected = ["meta.kiln.version 1 does not match the file version 2", "near_duplicates.num_perm",
                "document_rules[3].params.min_doc_words", "max_dropped_share must be a number",
                "expectations[13] (expect_vibes)", "expectations[14] (expect_column_values_to_be_between)"]
    assert len(problems) == len(expected)
    for fragment in expected:
        assert any(fragment in p for p in problems), (fragment, problems)
    assert captured.err.count(f"{path}: ") == len(expected) and "Traceback" not in captured.err
    path.write_text("{not json")
    assert main(["contract", "check", str(path)]) == 1
    assert "is not valid JSON" in capsys.readouterr().err
