"""The trainer SDK: kiln's guarantees behind a few calls, around any ``torch.nn.Module``.

The model, its optimizer and the forward of a step are the trainer's; everything else is the
session's: distributed init and seeding, the streaming loader (world-size-independent order, its
state checkpointed), the recipe's strategy (ddp or fsdp), committed checkpoints (sharded and
asynchronous, sealed manifest last, RNG and loader state) and the resume from them, the metrics
record (heartbeat, stragglers, scaling efficiency), and ``result.json``. A whole entry point::

    from kiln_trainer import sdk

    def main(argv: list[str] | None = None) -> int:
        return sdk.run(train, argv)                     # logging, exit codes, teardown

    def train(session: sdk.Session) -> None:
        model = session.wrap(MyModel(session.recipe.model).to(session.device), blocks=...)
        optimizer = torch.optim.AdamW(session.model.parameters(), lr=session.recipe.optim.lr)
        session.resume(optimizer)                       # newest committed checkpoint, or step 0
        model.train()
        while session.step < session.target_step:
            step = session.step + 1
            batch = session.next_batch()
            loss_sum = torch.zeros((), device=session.device)
            for x, y in session.micro_batches(batch):
                with session.autocast():
                    loss = my_loss(model(x), y) / session.accum_steps
                loss.backward()
                loss_sum += loss.detach()
            loss = session.mean_loss(loss_sum)
            if session.rejects(loss, batch):            # the guard rolled back
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.report(step, loss)                  # counted, checkpointed when due, hooks

``kiln_trainer.train`` is kiln's own trainer on it. Step hooks (``sdk.hooks``) carry what runs
around the steps; kiln's (fault injection, the loss guard, the startup profile, the straggler
watch, interval logging) are on by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from kiln_trainer.contract import EXIT_FATAL, EXIT_OK, EXIT_RETRYABLE
from kiln_trainer.contract.entrypoint import trainer_arg_parser
from kiln_trainer.distributed import env_int
from kiln_trainer.errors import STORAGE_ERRNOS, TrainerError, os_error_text
from kiln_trainer.sdk.hooks import StepHook, StepStats, default_hooks
from kiln_trainer.sdk.session import Session

__all__ = ["Session", "StepHook", "StepStats", "default_hooks", "parse_args", "run", "setup_logging", "start"]

log = logging.getLogger("kiln_trainer.train")


def parse_args(argv: Sequence[str] | None = None, *, prog: str = "trainer", description: str | None = None) -> argparse.Namespace:
    """The arguments kiln hands every rank (``contract.entrypoint.trainer_arg_parser``)."""
    return trainer_arg_parser(prog, description).parse_args(None if argv is None else list(argv))


def start(args: argparse.Namespace, *, hooks: list[StepHook] | None = None) -> Session:
    """``Session.start``: distributed init, threads, the loader, rank 0's metrics, the same seed everywhere."""
    return Session.start(args, hooks=hooks)


def setup_logging() -> None:
    """Rank 0 logs INFO, the others WARNING, every line tagged with its rank, to stderr."""
    rank = env_int("RANK", 0)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(
    train: Callable[[Session], None], argv: Sequence[str] | None = None, *, prog: str = "trainer",
    description: str | None = None, hooks: list[StepHook] | None = None,
) -> int:
    """An entry point's ``main``: parse ``argv``, start a session, ``train(session)``, finish (rank 0
    prints the result), close; the contract's exit code: 0 done, 2 a fault the trainer diagnosed (a
    ``TrainerError``, or a full or read-only disk), 1 a retryable one (and a crash raises)."""
    setup_logging()
    args = parse_args(argv, prog=prog, description=description)
    session: Session | None = None
    try:
        session = start(args, hooks=hooks)
        train(session)
        result = session.finish()
        finished, session = session, None
        finished.close()  # a final write that fails (a full disk) fails the run too
        if result is not None:
            print(json.dumps(result, sort_keys=True))
        return EXIT_OK
    except TrainerError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return EXIT_RETRYABLE if exc.retryable else EXIT_FATAL  # a remote store that may heal: a retry can succeed
    except OSError as exc:
        if exc.errno not in STORAGE_ERRNOS:
            raise
        log.error("StorageError: %s", os_error_text(exc))
        return EXIT_FATAL
    finally:
        if session is not None:
            _close_after_failure(session)


def _close_after_failure(session: Session) -> None:
    """Close a session that already failed: the first error is the one to report (closing on a full
    disk fails again, flushing the same metrics)."""
    try:
        session.close()
    except Exception as exc:
        log.warning("closing the failed run: %s: %s", type(exc).__name__, exc)
