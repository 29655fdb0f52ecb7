"""The trainer SDK around a model that is not kiln's GPT: the loop of the SDK's docstring, in this
process (world size 1), under both strategies. Committed checkpoints, result.json and the metrics
record come out as kiln's trainer writes them; a stop at --max-steps resumes to the same weights as
an uninterrupted run; a ddp checkpoint resumes under fsdp; a hook of the user's own sees every step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln_trainer import sdk
from kiln_trainer.checkpoint import load_model_weights, weights_sha256
from kiln_trainer.checkpoint_manifest import latest_committed, verify_checkpoint

from trainer_fixtures import SHORT, TINY, read_result

pytestmark = pytest.mark.slow


class TinyLM(torch.nn.Module):
    """Embedding, two residual MLP layers, a head: a causal LM that only ever sees one token back."""

    def __init__(self, vocab: int, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(2)
        )
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


class Seen(sdk.StepHook):
    """A user's hook: what the session told it, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_start(self, session: sdk.Session) -> None:
        self.calls.append(("start", session.step))

    def on_step_end(self, session: sdk.Session, stats: sdk.StepStats) -> None:
        assert stats.tokens == session.tokens_per_step and stats.step_s > 0
        self.calls.append(("step", stats.step))

    def on_save(self, session: sdk.Session, step: int, blocked_s: float) -> None:
        self.calls.append(("save", step))


def train(session: sdk.Session) -> None:
    """The SDK docstring's loop, with TinyLM and a plain AdamW."""
    net = TinyLM(session.recipe.model.vocab_size).to(session.device)
    model = session.wrap(net, blocks=net.layers)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    session.resume(optimizer)
    model.train()
    while session.step < session.target_step:
        step = session.step + 1
        batch = session.next_batch()
        loss_sum = torch.zeros((), device=session.device)
        for x, y in session.micro_batches(batch):
            with session.autocast():
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)) / session.accum_steps
            loss.backward()
            loss_sum += loss.detach()
        loss_value = session.mean_loss(loss_sum)
        if session.rejects(loss_value, batch):
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        session.report(step, loss_value)


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KILN_TORCH_THREADS", "1")


def _argv(corpus: Path, run_dir: Path, *overrides: str, max_steps: int | None = None) -> list[str]:
    argv = ["--manifest", str(corpus), "--recipe", str(TINY), "--run-dir", str(run_dir)]
    for o in (*SHORT, *overrides):
        argv += ["--set", o]
    return argv + (["--max-steps", str(max_steps)] if max_steps is not None else [])


def _run(corpus: Path, run_dir: Path, *overrides: str, max_steps: int | None = None,
         hooks: list[sdk.StepHook] | None = None) -> int:
    return sdk.run(train, _argv(corpus, run_dir, *overrides, max_steps=max_steps), hooks=hooks)


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted ddp run of TinyLM (24 steps, checkpoints every 8)."""
    mp = pytest.MonkeyPatch()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        mp.delenv(name, raising=False)
    mp.setenv("KILN_TORCH_THREADS", "1")
    try:
        run_dir = tmp_path_factory.mktemp("sdk-ref") / "run"
        assert _run(corpus, run_dir) == 0
    finally:
        mp.undo()
    return run_dir


def test_a_model_of_its_own_gets_kilns_outputs(reference: Path) -> None:
    result = read_result(reference)
    assert result["kind"] == "kiln.TrainResult" and result["step"] == 24 and result["completed"] is True
    manifest = verify_checkpoint(result["checkpoint"])
    assert manifest["strategy"] == "ddp" and result["weights_sha256"] == manifest["weights_sha256"]
    _, weights = load_model_weights(result["checkpoint"])
    assert sorted(weights) == sorted(TinyLM(8).state_dict())  # the user's model, not a GPT
    assert result["metrics"]["final_loss"] < 5.0 and result["metrics"]["train_tokens"] == 24 * 16 * 64
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [4, 8, 12, 16, 20, 24]
    assert [r["step"] for r in records if "rank_step_times" in r] == [5, 10, 15, 20]
    assert [r["step"] for r in records if r.get("event") == "startup"] == [1]
    assert (reference / "training_manifest.json").exists() and "kiln_train_step" in (reference / "metrics.prom").read_text()


@pytest.mark.usefixtures("in_process")
def test_stop_then_resume_matches_uninterrupted_and_hooks_see_every_step(
    reference: Path, corpus: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    assert _run(corpus, run_dir, max_steps=10) == 0
    assert read_result(run_dir)["step"] == 10 and read_result(run_dir)["completed"] is False
    seen = Seen()
    assert _run(corpus, run_dir, hooks=[*sdk.default_hooks(), seen]) == 0
    assert seen.calls[0] == ("start", 10)
    assert [s for kind, s in seen.calls if kind == "step"] == list(range(11, 25))
    assert [s for kind, s in seen.calls if kind == "save"] == [16, 24]
    assert read_result(run_dir)["weights_sha256"] == read_result(reference)["weights_sha256"]


@pytest.mark.usefixtures("in_process")
def test_fsdp_saves_sharded_and_resumes_a_ddp_checkpoint(reference: Path, corpus: Path, tmp_path: Path) -> None:
    """A ddp checkpoint of step 16 (format 2) resumes under fsdp (format 3 from then on); the weights
    hash of the sharded save is read back from its shards, with no model built to read them."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000024")
    (run_dir / "result.json").unlink()
    assert _run(corpus, run_dir, "parallel.strategy=fsdp") == 0
    result = read_result(run_dir)
    manifest = verify_checkpoint(result["checkpoint"])
    assert manifest["strategy"] == "fsdp" and result["step"] == 24
    _, weights = load_model_weights(result["checkpoint"])
    assert weights_sha256(weights) == result["weights_sha256"]
    # The same training up to float summation order as the uninterrupted ddp run.
    _, ref_weights = load_model_weights(read_result(reference)["checkpoint"])
    for name, tensor in ref_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5)
    assert latest_committed(run_dir) == Path(result["checkpoint"])


def test_a_session_refuses_calls_out_of_order(corpus: Path, tmp_path: Path, in_process: Any) -> None:
    def no_wrap(session: sdk.Session) -> None:
        session.resume(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))

    assert sdk.run(no_wrap, _argv(corpus, tmp_path / "run")) == 2


def test_finish_writes_the_last_metrics_before_result_json(
    corpus: Path, tmp_path: Path, in_process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metrics.prom is written by a thread of its own (test_metrics); finish waits for its last write
    before result.json, written last of all. The last write is held until result.json appears (or
    2 s pass): a finish that did not wait for it would write result.json first."""
    from kiln_trainer import metrics

    real = metrics.atomic_write_bytes
    run_dir = tmp_path / "run"
    steps_written: list[int] = []
    result_first: list[bool] = []

    def held(path: Path, data: bytes, **kwargs: Any) -> Path:
        step = int(next(line for line in data.decode().splitlines() if line.startswith("kiln_train_step{")).split()[-1])
        if step == 12:
            deadline = time.monotonic() + 2.0
            while not (run_dir / "result.json").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            result_first.append((run_dir / "result.json").exists())
        steps_written.append(step)
        return real(path, data, **kwargs)

    monkeypatch.setattr(metrics, "atomic_write_bytes", held)
    assert _run(corpus, run_dir, max_steps=12) == 0
    assert result_first == [False] and steps_written[-1] == 12
    assert 'kiln_train_step{run_dir="' in (run_dir / "metrics.prom").read_text()
    assert (run_dir / "metrics.prom").stat().st_mtime_ns <= (run_dir / "result.json").stat().st_mtime_ns
