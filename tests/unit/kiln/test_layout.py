"""The package layout's rules, as docs/architecture.md states them: Airflow is imported only by the
adapters in ``kiln.airflow``; the trainer never imports kiln or Airflow."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _importers(root: Path, top: str, *, allowed: Path | None = None) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: {name}"
            for path in sorted(root.rglob("*.py")) if "_shipped" not in path.parts
            and not (allowed and path.is_relative_to(allowed))
            for line, name in _imports(path) if name == top or name.startswith(f"{top}.")]


def test_airflow_is_imported_only_by_the_adapters_in_kiln_airflow():
    kiln = REPO / "src" / "kiln"
    assert _importers(kiln, "airflow", allowed=kiln / "airflow") == []
    assert _importers(kiln / "airflow", "airflow"), "the adapters import Airflow (else this test looks nowhere)"


def test_the_trainer_imports_neither_kiln_nor_airflow():
    trainer = REPO / "training" / "kiln_trainer"
    assert _importers(trainer, "kiln") == [] and _importers(trainer, "airflow") == []


def test_every_json_kiln_reads_goes_through_the_one_bounded_reader():
    """``json.load``/``json.loads`` recurse without a bound and read any size: kiln and its trainer call
    them only inside ``kiln_trainer.jsonfile``, which bounds size, depth and numbers first."""
    owner = REPO / "training" / "kiln_trainer" / "jsonfile.py"
    calls = []
    for root in (REPO / "src" / "kiln", REPO / "training" / "kiln_trainer"):
        for path in sorted(root.rglob("*.py")):
            if path == owner or "_shipped" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr in ("load", "loads")
                        and isinstance(node.value, ast.Name) and node.value.id == "json"):
                    calls.append(f"{path.relative_to(REPO)}:{node.lineno}: json.{node.attr}")
    assert not calls, "parse JSON with kiln_trainer.jsonfile (kiln.util.fs re-exports it):\n" + "\n".join(calls)


TRAINER_IMPORTERS_ALLOWED: dict[str, tuple[tuple[str, ...], str]] = {
    "src/kiln/cli/tokenize.py": (("kiln_trainer.data", "kiln_trainer.packed", "kiln_trainer.tokenizer"),
                                 "`kiln tokenize` packs tokens in-process with the trainer's own packer and tokenizer"),
    "src/kiln/cli/train.py": (("kiln_trainer.evaluate",),
                              "`kiln evaluate` runs the trainer's evaluation (its model, torch) behind kiln's checks"),
    "src/kiln/conformance/checks.py": (("kiln_trainer.checkpoint",),
                                       "the conformance kit compares two runs' final weights, of any strategy and world "
                                       "size, with the trainer's consolidating loader (lazily: only that check loads torch)"),
    "src/kiln/launchers/base.py": (("kiln_trainer.config",),
                                   "the recipe's schema is the trainer's: what it would refuse is refused before any worker"),
    "src/kiln/launchers/worker.py": (("kiln_trainer.packed",),
                                     "torchrun's entry point: its agent warms the data path with the trainer's reader"),
    "src/kiln/provenance/reproduce.py": (("kiln_trainer.export", "kiln_trainer.mixture", "kiln_trainer.sample_order"),
                                         "`kiln reproduce --world-size N` exports the re-derived checkpoint as "
                                         "registration does (the registered folder's tensors, same names) and checks the "
                                         "ranks' global batches against the sample order the seed and the step give (a "
                                         "mixture's: the Mixture draw's)"),
    "src/kiln/registry/register.py": (("kiln_trainer.export",),
                                      "the HF export work (issue 30, item 4) owns it now"),
    "src/kiln/stages/inputs.py": (("kiln_trainer.config",),
                                  "the recipe's schema is the trainer's: a run's recipe resolves as the trainer will resolve it"),
    "src/kiln/stages/tokenize.py": (("kiln_trainer.packed", "kiln_trainer.remote", "kiln_trainer.tokenizer"),
                                    "the tokenize stage packs tokens in-process with the trainer's own packer and tokenizer"),
}
"""The modules of kiln that still import the trainer beyond its contract: what they import, and why
(2026-12-06)."""


def _trainer_modules_imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from kiln_trainer import train`` imports the module kiln_trainer.train
            found |= ({f"{node.module}.{alias.name}" for alias in node.names} if node.module == "kiln_trainer"
                      else {node.module})
    return {name for name in found if (name == "kiln_trainer" or name.startswith("kiln_trainer."))
            and not (name == "kiln_trainer.contract" or name.startswith("kiln_trainer.contract."))}


def test_kiln_imports_the_trainer_contract_and_no_new_part_of_the_trainer():
    """The orchestration side imports of the trainer only ``kiln_trainer.contract`` and its modules (the
    run dir's names, the TrainingManifest and checkpoint manifest readers, the TrainResult schema, the
    ranks' environment, exit codes and the error tree, the metrics record and the straggler rule, the
    atomic write and the bounded JSON reader). ``TRAINER_IMPORTERS_ALLOWED`` lists the exceptions, each
    with its reason (the modules that run trainer code in-process): a new importer, or a new trainer
    module imported by a listed one, fails here; a dropped import must be struck from the list, so it
    only shrinks."""
    kiln = REPO / "src" / "kiln"
    importers = {str(path.relative_to(REPO)): tuple(sorted(modules))
                 for path in sorted(kiln.rglob("*.py")) if "_shipped" not in path.parts
                 if (modules := _trainer_modules_imported(path))}
    allowed = {path: modules for path, (modules, _why) in TRAINER_IMPORTERS_ALLOWED.items()}
    new = {k: v for k, v in importers.items() if set(v) - set(allowed.get(k, ()))}
    assert not new, f"import the trainer contract (kiln_trainer.contract), not these: {new}"
    assert importers == allowed, "an import is gone: strike it from TRAINER_IMPORTERS_ALLOWED"
    assert all(why for _modules, why in TRAINER_IMPORTERS_ALLOWED.values()), "every exception says why"


def test_the_contract_rule_sees_every_form_of_import(tmp_path: Path):
    module = tmp_path / "m.py"
    module.write_text("import kiln_trainer.train\nfrom kiln_trainer import packed, contract\n"
                      "def f():\n    from kiln_trainer.config import load_recipe\n"
                      "from kiln_trainer.contract import RESULT_FILE\nfrom kiln.runs import RESULT_FILE\n"
                      "from kiln_trainer.contract.training_manifest import load_training_manifest\n"
                      "import kiln_trainer.contractual\n")
    assert _trainer_modules_imported(module) == {"kiln_trainer.train", "kiln_trainer.packed", "kiln_trainer.config",
                                                 "kiln_trainer.contractual"}
