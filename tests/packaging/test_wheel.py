"""kiln as an image build or a private index installs it: wheels, not an editable checkout.

kiln's wheel and the trainer's (kiln-trainer, a dependency of kiln's) are built from this checkout
and installed (``--no-deps``) into a fresh venv whose only other packages are the project venv's
dependencies (a ``.pth`` line; the checkout's editable kiln and kiln-trainer are not on that path).
Everything then runs from a folder outside the checkout: ``kiln --help``, a shard validated against
the shipped ``stdlib-py@1`` contract, and the shipped DAG files parsed by Airflow's DagBag — all
from the installed copy."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from wheel_builds import build_wheel, clean_copy, isolated_env

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("wheel")
    source = clean_copy(work / "source")
    dist = work / "dist"
    wheel = build_wheel(source, dist, "kiln")
    trainer_wheel = build_wheel(source / "training", dist, "kiln-trainer")  # a dependency of kiln's
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.namelist()
        requires = [line for line in archive.read(f"kiln-{wheel.name.split('-')[1]}.dist-info/METADATA").decode().splitlines()
                    if line.startswith("Requires-Dist: kiln-trainer")]
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "kiln-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index", str(wheel),
         str(trainer_wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stderr
    outside = work / "elsewhere"
    outside.mkdir()
    return {"venv": venv, "python": python, "purelib": purelib, "cwd": outside, "home": work / "kiln-home",
            "shipped": shipped, "requires": requires}


def _run(installed: dict[str, Path], *argv: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = isolated_env(installed["venv"], KILN_HOME=str(installed["home"]), AIRFLOW_HOME=str(installed["home"] / "airflow"))
    return subprocess.run(list(argv), cwd=installed["cwd"], env=env, capture_output=True, text=True, timeout=timeout)


def test_the_installed_copy_is_what_runs_and_it_ships_its_files(installed):
    probe = _run(installed, str(installed["python"]), "-c", textwrap.dedent("""
        import json, kiln, kiln_trainer, kiln.launchers, kiln.shipped as s
        print(json.dumps({"kiln": kiln.__file__, "kiln_trainer": kiln_trainer.__file__, "launchers": kiln.launchers.__file__,
                          "checkout": s.in_checkout(),
                          "files": {n: sorted(p.name for p in d.iterdir() if p.name != "__pycache__") for n, d in
                                    [("contracts", s.CONTRACTS_DIR), ("recipes", s.RECIPES_DIR), ("dags", s.DAGS_DIR),
                                     ("plugins", s.PLUGINS_DIR), ("config", s.CONFIG_DIR), ("mixtures", s.MIXTURES_DIR)]}}))
    """))
    assert probe.returncode == 0, probe.stderr
    facts = json.loads(probe.stdout)
    for module in ("kiln", "kiln_trainer", "launchers"):
        assert Path(facts[module]).is_relative_to(installed["purelib"]), f"{module} came from {facts[module]}"
    assert facts["checkout"] is False
    assert facts["files"]["contracts"] == sorted(p.name for p in (ROOT / "data_contracts").iterdir() if p.is_dir())
    assert {"stdlib-py", "web-text", "prose-wrapped", "source-code"} <= set(facts["files"]["contracts"])
    assert facts["files"]["mixtures"] == sorted(p.name for p in (ROOT / "training" / "mixtures").glob("*.toml"))
    assert "code-and-prose.toml" in facts["files"]["mixtures"]  # the sandbox form offers what it finds there
    assert {"tiny.toml", "small.toml", "production"} <= set(facts["files"]["recipes"])
    assert facts["files"]["dags"] == sorted(p.name for p in (ROOT / "dags").glob("*.py"))
    assert "kiln_signals.py" in facts["files"]["plugins"]
    assert facts["files"]["config"] == ["production.toml"]  # the production policy reads it at import


def test_test_and_dev_tooling_is_not_in_the_wheel(installed):
    """The chaos suite and the Slurm test cluster live in devtools/, outside the installed package; the
    trainer is its own distribution, which kiln requires at its exact version."""
    packages = sorted({name.split("/")[0] for name in installed["shipped"] if not name.startswith("kiln-")})
    assert packages == ["kiln"], packages
    assert installed["requires"] == ["Requires-Dist: kiln-trainer[export,mlflow,s3]==0.1.0"], installed["requires"]
    assert not [n for n in installed["shipped"] if "chaos" in n or "slurm_cluster" in n]


def test_kiln_help_runs_from_the_installed_console_script(installed):
    result = _run(installed, str(installed["venv"] / "bin" / "kiln"), "--help")
    assert result.returncode == 0, result.stderr
    assert "validate" in result.stdout and "snapshot" in result.stdout


def test_a_shard_validates_against_the_shipped_contract(installed):
    kiln = str(installed["venv"] / "bin" / "kiln")
    corpus = installed["cwd"] / "corpus"
    built = _run(installed, kiln, "corpus", "build", "--out", str(corpus), "--shards", "2")
    assert built.returncode == 0, built.stderr
    result = _run(installed, kiln, "validate", str(corpus), "--contract", "stdlib-py@1", "--report", "report.json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["contract"] == "stdlib-py@1" and summary["healthy"] == 2 and summary["gate"] == "pass"
    assert (installed["cwd"] / "report.json").is_file()


def test_the_shipped_dag_files_import(installed):
    probe = _run(installed, str(installed["python"]), "-c", textwrap.dedent("""
        import json
        from airflow.dag_processing.dagbag import DagBag
        import kiln.shipped as s
        bag = DagBag(dag_folder=str(s.DAGS_DIR))
        print(json.dumps({"errors": {k: str(v)[:500] for k, v in bag.import_errors.items()}, "dags": sorted(bag.dag_ids),
                          "folder": str(s.DAGS_DIR)}))
    """))
    assert probe.returncode == 0, probe.stderr[-3000:]
    facts = json.loads(probe.stdout.strip().splitlines()[-1])
    assert facts["errors"] == {}
    assert facts["dags"] == ["kiln_champion_watch", "kiln_production", "kiln_reproduce", "kiln_sandbox"]
    assert Path(facts["folder"]).is_relative_to(installed["purelib"])
