"""The trainer side installs without Airflow: the ``kiln-trainer`` distribution (training/pyproject.toml).

A platform team's training image installs only the trainer and what it declares
(docker/trainer.Dockerfile). Checked here:

* its declared dependencies are what ``kiln_trainer`` imports (lazy imports inside functions
  included), and their pins agree with constraints.txt and with kiln's own pyproject.toml, which
  requires the trainer at its exact version;
* (slow) its wheel, built from this checkout, installs into a fresh venv with its dependencies
  resolved under the lock (torch from the local CPU wheel where ``/opt/wheels`` has it) and nothing
  else: Airflow, MLflow, DVC, Great Expectations and kiln are not there, the SDK and the contract
  import, and kiln's trainer trains two steps to a committed checkpoint, on its own and, as the
  trainer image runs it, under torchrun through kiln's worker (kiln's source without its
  dependencies, as the image's ``--no-deps`` install).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kiln.data.corpus import build_corpus
from kiln.refs import TrainingManifest
from kiln_trainer.contract.checkpoint_manifest import verify_checkpoint

from wheel_builds import ROOT, build_wheel, clean_copy, isolated_env

TRAINER = ROOT / "training"
ABSENT = ("airflow", "mlflow", "dvc", "great_expectations", "kiln", "transformers")
"""Not in a venv of the trainer alone: the orchestration side, its services' clients, and the export's
Hugging Face library (an extra, ``kiln-trainer[export]``)."""
WHEELS = Path("/opt/wheels")
"""The CPU build of the locked torch, on this kind of machine's disk (the Makefile installs it from there)."""
TINY_RUN = ("train.steps=2", "checkpoint.every_steps=2", "train.log_every=1", "model.n_layer=1", "model.n_embd=16",
            "model.block_size=16", "optim.warmup_steps=0")


def _project(pyproject: Path) -> dict[str, Any]:
    return tomllib.loads(pyproject.read_text())["project"]


def _declared(project: dict[str, Any], extras: set[str] | None = None) -> list[Requirement]:
    """A project's requirements: its dependencies and those of ``extras`` (every extra when None)."""
    optional = project.get("optional-dependencies", {})
    chosen = set(optional) if extras is None else extras
    return [Requirement(d) for d in project["dependencies"]] + [Requirement(d) for e in sorted(chosen) for d in optional[e]]


def _lock() -> dict[str, str]:
    """constraints.txt: name -> exact version (a local label such as ``+cpu`` dropped)."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = spec.version.split("+")[0]
    return pins


def _imported_tops(package: Path) -> dict[str, list[str]]:
    """Top-level modules a package's files import, anywhere in them (a lazy import inside a function
    too), that are neither the standard library's nor the package's own: module -> the files."""
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - {package.name}:
                found.setdefault(top, []).append(str(path.relative_to(package.parent)))
    return found


def test_the_trainer_declares_what_it_imports_and_nothing_of_the_orchestration_side():
    """Every third-party module kiln_trainer imports comes from a distribution it declares (in its
    dependencies or an extra), or from one of theirs (botocore is boto3's)."""
    declared = {canonicalize_name(r.name) for r in _declared(_project(TRAINER / "pyproject.toml"))}
    provided = importlib.metadata.packages_distributions()
    reachable = set(declared)
    for name in declared:
        reachable |= {canonicalize_name(Requirement(r).name) for r in importlib.metadata.requires(name) or []}
    undeclared = {}
    for top, files in _imported_tops(TRAINER / "kiln_trainer").items():
        distributions = {canonicalize_name(d) for d in provided.get(top, [])}
        if not distributions & reachable:
            undeclared[top] = (sorted(distributions), files)
    assert not undeclared, f"kiln_trainer imports what training/pyproject.toml does not declare: {undeclared}"
    assert not {n for n in declared if "airflow" in n or n in ("dvc", "great-expectations", "kiln")}, declared


def test_the_rule_sees_a_lazy_import(tmp_path: Path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("import os\nfrom pkg import x\ndef f():\n    from yaml import safe_load\n")
    assert _imported_tops(package) == {"yaml": ["pkg/m.py"]}


def test_the_trainer_pins_agree_with_the_lock_and_kiln_requires_its_exact_version():
    trainer, kiln, lock = _project(TRAINER / "pyproject.toml"), _project(ROOT / "pyproject.toml"), _lock()
    kiln_pins = {canonicalize_name(r.name): str(r.specifier) for r in _declared(kiln)}
    for req in _declared(trainer):
        name = canonicalize_name(req.name)
        assert name in lock, f"training/pyproject.toml: {req} is not in constraints.txt"
        assert req.specifier.contains(lock[name]), f"training/pyproject.toml: {req} disagrees with constraints.txt ({lock[name]})"
        if req.specifier and name in kiln_pins and kiln_pins[name]:
            assert str(req.specifier) == kiln_pins[name].split("+")[0], f"{req}: kiln's pyproject.toml says {kiln_pins[name]}"
    assert trainer["requires-python"] == kiln["requires-python"]
    (dependency,) = [r for r in _declared(kiln) if canonicalize_name(r.name) == "kiln-trainer"]
    assert str(dependency.specifier) == f"=={trainer['version']}", "kiln requires the trainer of its own checkout"
    assert dependency.extras <= set(trainer["optional-dependencies"]), dependency.extras


# ------------------------------------------------------------------------- the wheel in a fresh venv
@pytest.fixture(scope="module")
def trainer_venv(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("trainer-wheel")
    source = clean_copy(work / "source")
    wheel = build_wheel(source / "training", work / "dist", "kiln-trainer")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    find_links = ["--find-links", str(WHEELS)] if WHEELS.is_dir() else []
    install = subprocess.run(
        [str(Path(sys.executable).with_name("uv")), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
         *find_links, "-c", str(ROOT / "constraints.txt"), str(wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stderr
    outside = work / "elsewhere"
    outside.mkdir()
    return {"venv": venv, "python": venv / "bin" / "python", "source": source, "cwd": outside}


def _run(venv: dict[str, Path], *argv: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), cwd=venv["cwd"], env=isolated_env(venv["venv"], **env), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_trainer_installs_alone_and_its_sdk_and_contract_import(trainer_venv):
    probe = _run(trainer_venv, str(trainer_venv["python"]), "-c", textwrap.dedent(f"""
        import importlib.metadata, importlib.util, json, sysconfig
        import kiln_trainer.contract, kiln_trainer.sdk, kiln_trainer.train
        print(json.dumps({{
            "file": kiln_trainer.sdk.__file__, "purelib": sysconfig.get_paths()["purelib"],
            "importable": [m for m in {list(ABSENT)!r} if importlib.util.find_spec(m) is not None],
            "installed": sorted(d.metadata["Name"] for d in importlib.metadata.distributions()),
            "torch": importlib.metadata.version("torch"),
        }}))
    """))
    assert probe.returncode == 0, probe.stderr[-3000:]
    facts = json.loads(probe.stdout)
    assert Path(facts["file"]).is_relative_to(facts["purelib"]), facts["file"]
    assert facts["importable"] == [], f"a venv of the trainer alone can import {facts['importable']}"
    installed = {canonicalize_name(n) for n in facts["installed"]}
    assert {"kiln-trainer", "torch", "numpy", "pyarrow", "tokenizers"} <= installed, installed
    assert not {n for n in installed if "airflow" in n or n.startswith(("mlflow", "dvc", "great-expectations"))}, installed
    assert facts["torch"].split("+")[0] == _lock()["torch"], facts["torch"]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TrainingManifest, as kiln writes one, over two shards of the sample corpus and its eval split."""
    root = tmp_path_factory.mktemp("trainer-corpus")
    build_corpus(root / "corpus", shards=2, max_bytes=256 * 1024)

    def entries(folder: str) -> list[dict[str, Any]]:
        import pyarrow.parquet as pq

        return [{"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "rows": pq.read_metadata(p).num_rows}
                for p in sorted((root / "corpus" / folder).glob("*.parquet"))]

    built = TrainingManifest.build(snapshot_id="0" * 32 + ".dir", corpus="stdlib-py", contract="stdlib-py@1",
                                   shards=entries("train"), eval_shards=entries("eval"))
    return built.write(root / "manifest.json")


def _committed_steps(run_dir: Path) -> int:
    result = json.loads((run_dir / "result.json").read_text())
    assert result["completed"] and result["step"] == 2, result
    assert verify_checkpoint(result["checkpoint"])["step"] == 2
    return int(result["step"])


def _train_args(venv: dict[str, Path], manifest: Path, run_dir: Path) -> list[str]:
    args = ["--manifest", str(manifest), "--recipe", str(venv["source"] / "training" / "recipes" / "tiny.toml"),
            "--run-dir", str(run_dir)]
    for override in TINY_RUN:
        args += ["--set", override]
    return args


@pytest.mark.slow
def test_kilns_trainer_trains_in_a_venv_of_the_trainer_alone(trainer_venv, manifest):
    run_dir = trainer_venv["cwd"] / "run-alone"
    result = _run(trainer_venv, str(trainer_venv["python"]), "-m", "kiln_trainer.train",
                  *_train_args(trainer_venv, manifest, run_dir), KILN_TORCH_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _committed_steps(run_dir) == 2


@pytest.mark.slow
def test_the_trainer_images_entrypoint_trains_through_kilns_worker_without_kilns_dependencies(trainer_venv, manifest):
    """docker/trainer/entrypoint.sh's line: torchrun running ``kiln.launchers.worker``, whose kiln the
    image installs --no-deps; kiln's source on the path, none of its dependencies installed."""
    run_dir = trainer_venv["cwd"] / "run-worker"
    result = _run(trainer_venv, str(trainer_venv["venv"] / "bin" / "torchrun"), "--standalone", "--nproc-per-node=1",
                  "-m", "kiln.launchers.worker", *_train_args(trainer_venv, manifest, run_dir),
                  KILN_TORCH_THREADS="1", PYTHONPATH=str(trainer_venv["source"] / "src"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert _committed_steps(run_dir) == 2
