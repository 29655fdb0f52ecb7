"""kiln.runs: the run key, the run directory and its identity record.

The mapping (dag_id, run_id) → directory is checked as a property over generated ids (Hypothesis):
Airflow's own run-id alphabet, near-collisions that differ only in characters a sanitiser would
replace, arbitrary unicode (control characters, lone surrogates), up to Airflow's 250 characters.
"""

from __future__ import annotations

import json
import re
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kiln import runs
from kiln.errors import ConfigError, RunMismatchError

REPO = Path(__file__).resolve().parents[3]
NAME_MAX = 255  # bytes in one path component (ext4, xfs, tmpfs, btrfs)
PATH_MAX = 4096
AIRFLOW_DEFAULT_RUN_ID_PATTERN = r"^[A-Za-z0-9_.~:+-]+$"  # [scheduler] allowed_run_id_pattern in Airflow 3.3
AIRFLOW_ALPHABET = string.ascii_letters + string.digits + "_.~:+-"

# What a caller can hand in: Airflow's alphabet, a tiny alphabet full of sanitiser collisions
# (":" "_" "+" "~" all become "_"), and any unicode at all.
airflow_ids = st.text(alphabet=AIRFLOW_ALPHABET, min_size=1, max_size=runs.AIRFLOW_ID_MAX)
colliding_ids = st.text(alphabet="ab:_+~.-", min_size=1, max_size=6)
any_ids = st.text(alphabet=st.characters(codec=None, exclude_categories=()), min_size=1, max_size=runs.AIRFLOW_ID_MAX)
ids = st.one_of(airflow_ids, colliding_ids, any_ids)


def _valid(text: str) -> bool:
    return text not in (".", "..") and "/" not in text


identities = st.builds(runs.RunIdentity, ids.filter(_valid), ids.filter(_valid))


def _is_one_linux_component(name: str) -> bool:
    raw = name.encode("utf-8")
    return 0 < len(raw) <= NAME_MAX and b"/" not in raw and b"\0" not in raw and name not in (".", "..")


@settings(max_examples=400, deadline=None)
@given(st.lists(identities, min_size=2, max_size=30, unique=True))
@example([runs.RunIdentity("kiln_sandbox", "probe:col"), runs.RunIdentity("kiln_sandbox", "probe_col"),
          runs.RunIdentity("kiln_sandbox", "probe+col")])
@example([runs.RunIdentity("kiln_sandbox", "a" * 250), runs.RunIdentity("kiln_sandbox", "a" * 249 + "b")])
def test_run_directories_are_injective_plain_components_inside_the_runs_folder(many):
    root = Path("/var/lib/kiln/runs")
    paths = [runs.run_dir_path(identity, root) for identity in many]
    assert len(set(paths)) == len(many), "two runs share a directory"
    for identity, path in zip(many, paths, strict=True):
        dag_part, run_part = path.relative_to(root).parts
        assert _is_one_linux_component(dag_part) and _is_one_linux_component(run_part), path
        assert not dag_part.startswith((".", "-")) and not run_part.startswith((".", "-"))
        assert path == runs.run_dir_path(identity.key, root), "the key and the identity name the same directory"
        assert len(str(path).encode()) < PATH_MAX // 8
    # The dag part depends on the dag id alone: one DAG's runs share one folder.
    by_dag = {}
    for identity, path in zip(many, paths, strict=True):
        assert by_dag.setdefault(identity.dag_id, path.parent) == path.parent


@pytest.fixture(scope="module")
def runs_root():
    with tempfile.TemporaryDirectory(prefix="kiln-runs-") as tmp:
        yield Path(tmp) / "runs"


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(identities)
def test_a_made_run_directory_round_trips_to_its_exact_identity(runs_root, identity):
    path = runs.run_dir(identity, runs_root)
    assert path.is_dir() and path.resolve().parent.parent == runs_root.resolve()
    assert runs.read_identity(path) == identity
    assert runs.run_dir(identity.key, runs_root) == path  # a later use finds and accepts it
    assert runs.existing_run_dir(identity, runs_root) == path
    assert dict(runs.iter_run_dirs(runs_root))[path] == identity


@settings(max_examples=300, deadline=None)
@given(st.one_of(ids, st.just(""), st.just("a/b")), st.one_of(ids, st.just(""), st.just("."), st.just(".."), st.just("x/y")))
def test_every_id_pair_is_a_run_or_a_clear_error(dag_id, run_id):
    try:
        identity = runs.RunIdentity(dag_id, run_id)
    except ConfigError as exc:
        assert not (_valid(dag_id) and _valid(run_id) and dag_id and run_id)
        assert "does not name a run directory" in str(exc) or "non-empty" in str(exc)
        return
    assert runs.split_run_key(identity.key) == (dag_id, run_id)


def test_the_colliding_probe_ids_get_three_directories_with_readable_names(tmp_path):
    made = {rid: runs.run_dir(runs.run_key("kiln_sandbox", rid), tmp_path) for rid in ("probe:col", "probe_col", "probe+col")}
    assert len(set(made.values())) == 3
    assert all(p.name.startswith("probe_col-") and p.parent.name.startswith("kiln_sandbox-") for p in made.values())
    for rid, path in made.items():
        assert json.loads((path / runs.RUN_RECORD).read_text())["run_id"] == rid


def test_a_directory_recording_another_run_is_refused_by_writers_and_readers(tmp_path):
    key = runs.run_key("kiln_sandbox", "manual__1")
    path = runs.run_dir(key, tmp_path)
    (path / runs.RUN_RECORD).write_text(json.dumps(runs.RunIdentity("kiln_sandbox", "manual__2").to_json()))
    with pytest.raises(RunMismatchError, match="belongs to run 'kiln_sandbox/manual__2', not 'kiln_sandbox/manual__1'"):
        runs.run_dir(key, tmp_path)
    with pytest.raises(RunMismatchError, match="belongs to run"):
        runs.existing_run_dir(key, tmp_path)
    (path / runs.RUN_RECORD).write_text("{torn")
    with pytest.raises(RunMismatchError, match="unreadable"):
        runs.run_dir(key, tmp_path)


def test_reading_a_run_that_was_never_made_writes_nothing(tmp_path):
    assert runs.existing_run_dir(runs.run_key("kiln_sandbox", "never"), tmp_path) is None
    assert not tmp_path.joinpath("runs").exists() and list(tmp_path.iterdir()) == []
    assert list(runs.iter_run_dirs(tmp_path / "runs")) == []


def test_the_identity_record_is_written_once_and_whole(tmp_path):
    identity = runs.RunIdentity("kiln_sandbox", "manual__1")
    path = runs.run_dir(identity, tmp_path)
    record = path / runs.RUN_RECORD
    before = record.stat().st_ino
    runs.run_dir(identity, tmp_path)
    assert record.stat().st_ino == before and [p.name for p in path.iterdir()] == [runs.RUN_RECORD]  # no temp file left
    assert oct(record.stat().st_mode & 0o777) == "0o644"


def test_mlflow_filter_value_refuses_quotes_instead_of_dropping_them():
    assert runs.mlflow_filter_value("kiln_sandbox/manual__1") == "'kiln_sandbox/manual__1'"
    for bad in ("kiln_sandbox/it's", "kiln_sandbox/back\\slash"):
        with pytest.raises(ConfigError, match="quotes or backslashes"):
            runs.mlflow_filter_value(bad)


# ------------------------------------------------------------------------ Airflow's run-id pattern
PATTERN = re.compile(runs.ALLOWED_RUN_ID_PATTERN)


@settings(max_examples=300, deadline=None)
@given(st.one_of(airflow_ids, st.text(max_size=300)))
@example(".")
@example("..")
@example("probe\n")
@example("a" * 250)
@example("a" * 251)
def test_the_run_id_pattern_is_airflows_default_less_what_airflow_cannot_serve(run_id):
    by_default = re.match(AIRFLOW_DEFAULT_RUN_ID_PATTERN, run_id) is not None
    ours = PATTERN.match(run_id) is not None
    cannot_serve = run_id == "." or len(run_id) > runs.AIRFLOW_ID_MAX or run_id.endswith("\n")
    assert ours == (by_default and not cannot_serve)


@pytest.mark.parametrize("generated", ["manual__2026-12-01T22:43:33.898486+00:00", "scheduled__2026-11-30T03:00:00+00:00",
                                       "asset_triggered__2026-11-30T03:00:00.5+00:00", "backfill__2026-11-30T03:00:00+00:00"])
def test_the_run_id_pattern_accepts_every_id_airflow_generates(generated):
    assert PATTERN.match(generated)


@pytest.mark.parametrize("refused", [".", "a" * 251, "probe\n", "", "it's", "a/b"])
def test_the_run_id_pattern_refuses_what_airflow_cannot_serve(refused):
    assert not PATTERN.match(refused)


def test_every_airflow_kiln_configures_uses_the_run_id_pattern(tmp_path, monkeypatch):
    import yaml

    from kiln import settings as kiln_settings
    from kiln.stack import embedded, prodlike

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    s = kiln_settings.load()
    setting = "AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN"
    assert embedded.airflow_env(s)[setting] == runs.ALLOWED_RUN_ID_PATTERN
    assert prodlike.airflow_env(s, prodlike.state(s, create=True))[setting] == runs.ALLOWED_RUN_ID_PATTERN
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    airflow_services = [name for name in compose["services"] if name.startswith("airflow-")]
    assert airflow_services
    for name in airflow_services:
        assert compose["services"][name]["environment"][setting] == runs.ALLOWED_RUN_ID_PATTERN, name


# ------------------------------------------------------------------------- one home for the names
def test_no_module_but_the_owners_spells_a_file_name_of_a_run():
    """kiln.runs owns the names of a run directory; the names kiln and the trainer share (the trainer's
    files, the launchers' folder) live in the trainer contract, kiln_trainer.contract. Anywhere else a
    name is imported, never spelled."""
    import ast

    repo = Path(__file__).resolve().parents[3]
    names = {runs.RUN_RECORD, runs.QUARANTINE_JSON, runs.QUARANTINE_HTML, runs.TRAINING_MANIFEST, runs.EVAL_REPORT,
             runs.SUMMARY, runs.HELDOUT_MANIFEST, runs.REEVALUATION, runs.LAUNCH_SUBDIR, runs.LAUNCH_SPEC,
             runs.LAUNCH_STATUS, runs.LAUNCH_LOG, runs.LAUNCH_PREVIOUS_LOG, runs.SUPERVISOR_PID, runs.JOB_RECORD,
             runs.SLURM_EXCLUDED_NODES, runs.SLURM_SCRIPT, runs.SLURM_JOB_ID, runs.K8S_LOG, runs.ELASTIC_RECORD,
             *runs.TRAINER_FILES}
    owners = {repo / "src/kiln/runs.py", repo / "training/kiln_trainer/contract/__init__.py"}
    spelled = []
    for path in sorted([*(repo / "src/kiln").rglob("*.py"), *(repo / "training/kiln_trainer").rglob("*.py"),
                        *(repo / "plugins").glob("*.py"), *(repo / "dags").glob("*.py")]):
        if path in owners or "_shipped" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{path.relative_to(repo)}:{node.lineno}: {node.value!r}")
    assert not spelled, "run file names spelled outside kiln.runs:\n" + "\n".join(spelled)
