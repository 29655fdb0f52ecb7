from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import ConfigError, LaunchError
from kiln.launchers import LaunchSpec, agent_argv, read_result


def _spec(tmp_path: Path, **kw) -> LaunchSpec:
    return LaunchSpec(run_dir=tmp_path, manifest=tmp_path / "m.json", recipe=tmp_path / "r.toml", run_key="kiln_sandbox/manual__2026", **kw)


def test_agent_argv_forms_one_multi_node_gang(tmp_path):
    spec = _spec(tmp_path, nodes=2, max_restarts=3, overrides=("train.seed=7",), max_steps=20)
    argv = agent_argv(spec, 1, 29400)
    assert "--nnodes=2" in argv and "--node-rank=1" in argv and "--max-restarts=3" in argv
    assert "--rdzv-endpoint=127.0.0.1:29400" in argv and "--rdzv-backend=c10d" in argv
    assert any(a.startswith("--rdzv-id=kiln_sandbox_manual__2026") for a in argv)
    assert argv[len(argv) - 1 - argv[::-1].index("-m") + 1] == "kiln_trainer.train"
    assert argv[-4:] == ["--set", "train.seed=7", "--max-steps", "20"]


@pytest.mark.parametrize("field,value", [("nodes", 0), ("nproc_per_node", 0), ("max_restarts", -1), ("max_steps", 0)])
def test_launch_spec_names_the_bad_field(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        _spec(tmp_path, **{field: value})


def test_missing_result_is_a_launch_error(tmp_path):
    with pytest.raises(LaunchError, match="result.json"):
        read_result(tmp_path)
