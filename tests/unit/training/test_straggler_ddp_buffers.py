"""Stragglers under ddp with a model that has buffers: DDP broadcasts rank 0's buffers at the start
of every step's forward, a collective in which a healthy rank waits for a slow one. The strategy
times it on the CPU as blocked (``collective_s``), as it times FSDP2's all-gathers and
reduce-scatters, so the slow rank stands out and is flagged. (Without it the healthy rank's wait
counted as compute, every rank's window held the slow rank's time and no straggler was flagged.)

A user trainer on the SDK (``buffered_lm.py``, written below) trains a small LM whose forward keeps a
running mean of its activations in a registered buffer and subtracts it, as a norm layer does, so
the weights depend on DDP's buffer broadcast; 2 ranks under torchrun, rank 1 slowed by
``KILN_FAULT_SLOW_RANK`` (``kiln_trainer.faults``)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from trainer_fixtures import THREADS, TINY, group_of_one, read_result, run_ok, torchrun_cmd, trainer_env

TRAINER = '''
    """A user trainer on kiln's SDK whose model has a buffer (see the test module)."""
    import sys

    import torch
    import torch.nn.functional as F

    from kiln_trainer import sdk


    class BufferedLM(torch.nn.Module):
        def __init__(self, vocab: int, width: int = 32) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(2))
            self.head = torch.nn.Linear(width, vocab, bias=False)
            self.register_buffer("running_mean", torch.zeros(width))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            if self.training:
                with torch.no_grad():
                    self.running_mean.mul_(0.9).add_(h.mean((0, 1)), alpha=0.1)
            h = h - self.running_mean
            for layer in self.layers:
                h = h + layer(h)
            return self.head(h)


    def train(session: sdk.Session) -> None:
        net = BufferedLM(session.recipe.model.vocab_size).to(session.device)
        model = session.wrap(net, blocks=net.layers)
        optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
        session.resume(optimizer)
        model.train()
        while session.step < session.target_step:
            step = session.step + 1
            batch = session.next_batch()
            loss_sum = torch.zeros((), device=session.device)
            for x, y in session.micro_batches(batch):
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)) / session.accum_steps
                loss.backward()
                loss_sum += loss.detach()
            loss_value = session.mean_loss(loss_sum)
            if session.rejects(loss_value, batch):
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.report(step, loss_value)


    if __name__ == "__main__":
        sys.exit(sdk.run(train, sys.argv[1:]))
'''

SLOW_FROM = 6
OVERRIDES = ("parallel.strategy=ddp", "train.steps=20", "checkpoint.every_steps=20", "train.log_every=10",
             "optim.warmup_steps=4", "stragglers.every_steps=5", "stragglers.factor=3.0", "stragglers.windows=2")


def _train(corpus: Path, tmp_path: Path, name: str, **env: str) -> Path:
    script = tmp_path / "buffered_lm.py"
    if not script.exists():
        script.write_text(textwrap.dedent(TRAINER))
    run_dir = tmp_path / name
    args = [str(script), "--manifest", str(corpus), "--recipe", str(TINY), "--run-dir", str(run_dir)]
    for override in OVERRIDES:
        args += ["--set", override]
    run_ok(torchrun_cmd(2, args), timeout=300, env=trainer_env(**THREADS, OMP_NUM_THREADS="1", **env))
    return run_dir


@pytest.mark.slow
def test_a_slow_rank_is_flagged_under_ddp_with_model_buffers(corpus: Path, tmp_path: Path) -> None:
    slow = _train(corpus, tmp_path, "slow", KILN_FAULT_SLOW_RANK="1", KILN_FAULT_SLOW_S="0.3",
                  KILN_FAULT_SLOW_FROM_STEP=str(SLOW_FROM))
    records = [json.loads(line) for line in (slow / "metrics.jsonl").read_text().splitlines()]
    windows = {r["step"]: r["rank_step_times"] for r in records if "rank_step_times" in r}
    assert sorted(windows) == [5, 10, 15, 20]
    # From the fault on, rank 1's compute holds its 0.3 s sleep and rank 0's does not hold its wait.
    for step in (10, 15, 20):
        fast, slowed = windows[step]
        assert slowed >= 0.3 and slowed > 3 * fast, windows
    # Flagged after 2 slow windows: 10 and 15 (or 5 and 10, when this loaded host made the 3 ms
    # steps of rank 1 3x slower than rank 0's before the fault); never the healthy rank.
    flags = [(r["rank"], r["step"]) for r in records if r.get("event") == "straggler"]
    assert flags in ([(1, 15)], [(1, 10)]), (flags, windows)
    # Timing the broadcast changes no bit of the training: a clean run ends with the same weights.
    clean = _train(corpus, tmp_path, "clean")
    assert read_result(clean)["weights_sha256"] == read_result(slow)["weights_sha256"]


def test_ddps_timed_buffer_broadcast_keeps_its_work_and_adds_its_seconds() -> None:
    """The DDP the strategy builds on the CPU broadcasts buffers as DDP does (here rank 0's alone) and
    adds the seconds it took to the step's ``CollectiveWait``; a model without buffers adds none."""
    from torch import nn

    from kiln_trainer.parallel import TimedBufferSyncDDP
    from kiln_trainer.timing import CollectiveWait

    torch.manual_seed(0)
    with group_of_one():
        with_buffer = nn.BatchNorm1d(4)
        wait = CollectiveWait()
        ddp = TimedBufferSyncDDP(with_buffer, wait=wait)
        ddp(torch.randn(8, 4)).sum().backward()
        assert wait.seconds > 0 and int(with_buffer.num_batches_tracked) == 1
        wait.reset()
        plain = nn.Linear(4, 4)
        ddp = TimedBufferSyncDDP(plain, wait=wait)
        ddp(torch.randn(8, 4)).sum().backward()
        assert wait.seconds == 0.0
