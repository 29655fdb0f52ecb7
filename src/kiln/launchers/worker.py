"""The process torchrun starts on every rank: the trainer the recipe names, plus a marker when it exits 2.

    python -m kiln.launchers.worker --manifest M.json --recipe R.toml --run-dir RUN [...]

takes exactly the trainer's arguments, reads which trainer the recipe names (``trainer``: ``kiln``,
kiln's ``kiln_trainer.train:main``, or the user's ``package.module:function``;
``kiln_trainer.contract.entrypoint``) and calls that entry point with them in this process (no extra
process, so a SIGKILL of this pid is a SIGKILL of the trainer). A spec that does not resolve is a
fault a retry repeats: exit 2 with the marker, naming the spec (the launchers refuse it before any
worker starts, so this is for a recipe changed in between). torchrun cannot tell a diagnosed
fault (exit 2) from a crash and would restart both; the marker ``RUN/.launch/fatal/rank-N.json`` lets
the launcher end the job at once and fail it without retry.

**Agent mode** (the local backend's node agent; fast restarts)::

    python -m kiln.launchers.worker --agent <torchrun arguments> -m kiln.launchers.worker <trainer args>

is torchrun (the same arguments, parsed by torch's own parser, the same elastic agent), except that

* the trainer is imported once, in the agent, and every worker is *forked* from it
  (``--start-method=fork``, a function entry point): a restart after a crash skips the
  interpreter start and the torch/pyarrow imports (2-3 s of CPU, 5-15 s on a loaded host), and
  ``torch._dynamo``, which DDP's constructor imports (another 3-15 s). The agent never runs a torch
  op, an OpenMP pool or CUDA before forking, which is what makes fork safe. It also reads one
  shard of the run's manifest once (pyarrow's first read in a process costs seconds);
* the c10d rendezvous polls its store every 0.1 s instead of 1 s (torch's ``_delay`` between
  state syncs): with the store on this host the polling costs nothing and each re-rendezvous is
  1-2 s shorter. On a large cluster keep torch's default (plain torchrun, as the Slurm backend does);
* with ``torch._dynamo`` preloaded, the agent's log of a dead worker is instant too: torch's log
  formatter imports it to render any traceback (seconds, on the restart path, without the preload);
* elastic (``--nnodes=MIN:MAX``, the local backend's elastic shrink): the agent's *first* rendezvous
  waits for all MAX nodes, as a gang scheduler starts a job whole. torch's rule (once MIN nodes are
  in, wait ``last_call_timeout``, then go on with those there) holds from the second round on, so
  only a lost node that nobody replaces in time makes the group smaller, never an agent that was
  slow to import torch at the start.

Workers are children of the agent (their cmdline is the agent's, which names this module).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.launchers.base import FATAL_LINE, WORKER_MODULE
from kiln.runs import FATAL_SUBDIR, LAUNCH_SUBDIR
from kiln_trainer.contract import EXIT_FATAL, RecipeError

SDK_LOGGER = "kiln_trainer"
"""The trainer SDK's logger (``kiln_trainer.sdk.run`` logs the fault it exits 2 for under it)."""


class _LastError(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def _run_dir(argv: list[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--run-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--run-dir="):
            return Path(arg.split("=", 1)[1])
    return None


def write_fatal_marker(run_dir: Path, rank: int, error: str) -> Path:
    """``RUN/.launch/fatal/rank-N.json``; on a disk too full for its text, an empty one (a name costs
    no data blocks), which readers take as a fatal exit whose reason is in the log."""
    folder = run_dir / LAUNCH_SUBDIR / FATAL_SUBDIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"rank": rank, "exit_code": EXIT_FATAL, "error": error, "time": time.time()}))
        os.replace(tmp, path)  # readers see the whole marker or none
    except OSError:
        tmp.unlink(missing_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
    return path


def train_entrypoint(argv: list[str]) -> tuple[Callable[[list[str]], Any], str]:
    """The train entry point the recipe in ``argv`` names (``--recipe``, its ``trainer.*`` ``--set``
    overrides), imported, and the logger its errors are read from (its top-level package's name:
    ``kiln_trainer`` for ``kiln``). ``EntrypointError``/``RecipeError`` naming the spec or the recipe;
    a bad argument exits 2 (argparse)."""
    from kiln_trainer.contract.entrypoint import (
        KILN_TRAIN_ENTRYPOINT,
        KILN_TRAINER,
        load_entrypoint,
        parse_trainer_args,
        read_recipe_trainer,
        trainer_record,
    )

    args = parse_trainer_args(argv, prog=f"python -m {WORKER_MODULE}")
    spec = read_recipe_trainer(args.recipe, args.overrides)
    target = KILN_TRAIN_ENTRYPOINT if spec.train == KILN_TRAINER else spec.train
    function = load_entrypoint(spec.train)
    # The record every checkpoint's seal adds: its distribution lookup (a scan of the installed
    # distributions, ~0.3 s) happens here, at start-up (in the agent, before forking), not at the first save.
    trainer_record(spec)
    return function, target.split(".", 1)[0].split(":", 1)[0]


def _exit_code(returned: object) -> int:
    """An entry point's return value as the rank's exit status: an int as it is, ``None`` as
    ``EXIT_OK`` (as ``sys.exit(None)``), anything else a crash (1, retryable), said on stderr."""
    if returned is None:
        return 0
    if isinstance(returned, int) and not isinstance(returned, bool):
        return returned
    print(f"[worker] the train entry point returned {returned!r}, not an exit code (int): exit 1",
          file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--agent"]:
        return agent_main(argv[1:])
    errors = _LastError()
    loggers: list[logging.Logger] = []
    try:
        entrypoint, package = train_entrypoint(argv)  # kiln's: torch, only in the worker process
        # Not the root logger: a handler there would keep the trainer's logging.basicConfig from
        # installing its own, and its log would be lost. kiln_trainer's too: a trainer on the SDK
        # reports its faults there (sdk.run), not under its own package.
        loggers = [logging.getLogger(name) for name in dict.fromkeys((package, SDK_LOGGER))]
        for logger in loggers:
            logger.addHandler(errors)
        code = _exit_code(entrypoint(argv))
    except SystemExit as exc:  # argparse: a bad argument is a fault a retry repeats (exit 2 too)
        code = exc.code if isinstance(exc.code, int) else 1
    except RecipeError as exc:  # the recipe or its trainer spec (or a user trainer raising one): a retry repeats it
        errors.message = f"{type(exc).__name__}: {exc}"
        print(f"[worker] {errors.message}", file=sys.stderr, flush=True)
        code = EXIT_FATAL
    finally:
        for logger in loggers:
            logger.removeHandler(errors)
    run_dir = _run_dir(argv)
    if code == EXIT_FATAL and run_dir is not None:
        rank = int(os.environ.get("RANK", "0") or 0)
        print(f"{FATAL_LINE}rank {rank}: {errors.message}", file=sys.stderr, flush=True)
        try:
            write_fatal_marker(run_dir, rank, errors.message)
        except OSError as exc:  # the line above still reaches the local launcher
            print(f"[worker] rank {rank}: fatal marker not written: {exc}", file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            # Linger so the launcher (polling every 0.2 s) ends the gang before torchrun's monitor
            # (every 1 s) sees this exit and restarts a run that can only fail the same way.
            time.sleep(3)
    return code


def forked_worker(*argv: str) -> int:
    """Entry point of a worker forked from the agent: ``main``, with its exit status as the process's."""
    # A fork inherits the agent's handlers (torch elastic turns SIGTERM etc. into a Python exception,
    # which a rank blocked in a collective would only see when the call returns): restore what a
    # fresh interpreter has, so the agent's SIGTERM stops the rank at once.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = main(list(argv))
    if code:
        sys.exit(code)  # SystemExit passes torch's wrappers: the agent sees this exit status
    return 0


_RDZV_POLL_S = 0.1


def _fast_rendezvous_polling() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = getattr(dr, "_delay", None)
    if original is None:  # torch moved it: keep its default pace
        return

    def delay(seconds: float | tuple[float, float]) -> None:
        original(seconds if isinstance(seconds, tuple) else min(seconds, _RDZV_POLL_S))

    dr._delay = delay


def _whole_first_gang() -> None:
    """The first rendezvous of each agent (its handler's first ``next_rendezvous``) needs MAX nodes;
    later ones use MIN as torch does. torch holds MIN in a frozen ``RendezvousSettings`` shared by the
    handler, its state holder and its op executor, so the round runs with a copy saying MIN = MAX."""
    import dataclasses

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    handler_class = getattr(dr, "DynamicRendezvousHandler", None)
    original = getattr(handler_class, "next_rendezvous", None)
    if handler_class is None or original is None or getattr(handler_class, "_kiln_whole_first_gang", False):
        return  # torch moved it (keep its rule), or done already

    def next_rendezvous(self: Any) -> Any:
        if getattr(self, "_kiln_gang_formed", False):
            return original(self)
        holders = [h for h in (self, getattr(self, "_state_holder", None), getattr(self, "_op_executor", None))
                   if h is not None and hasattr(h, "_settings")]
        settings = self._settings
        for holder in holders:
            holder._settings = dataclasses.replace(settings, min_nodes=settings.max_nodes)
        try:
            return original(self)
        finally:
            for holder in holders:
                holder._settings = settings
            self._kiln_gang_formed = True

    handler_class.next_rendezvous = next_rendezvous
    handler_class._kiln_whole_first_gang = True


def _warm_data_path(trainer_argv: list[str]) -> None:
    """A process's first parquet read costs seconds (pyarrow's lazy initialisation; 4 s at load 20
    here, 0.04 s the second time): read one shard of the run's manifest before forking, so each
    worker pays only its own read and sha256 check (which it still does, on every start)."""
    try:
        from kiln_trainer.contract.entrypoint import parse_trainer_args
        from kiln_trainer.contract.training_manifest import load_training_manifest
        from kiln_trainer.packed import iter_training_texts

        manifest = load_training_manifest(parse_trainer_args(trainer_argv).manifest)
        next(iter_training_texts(manifest.shards[:1]), None)
    except (Exception, SystemExit):
        pass  # a bad manifest, argument or shard is the worker's to diagnose and report (exit 2)


def _preload_trainer(trainer_argv: list[str]) -> None:
    """Import the recipe's train entry point once, in the agent, so every forked worker has it."""
    # A bad spec, recipe or argument is the worker's to report (exit 2, with the marker).
    with contextlib.suppress(Exception, SystemExit):
        train_entrypoint(trainer_argv)


def agent_main(argv: list[str]) -> int:
    """One node's torchrun agent that forks preloaded workers (see the module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(argv)
    if not (args.module and args.training_script == __spec__.name):
        raise SystemExit(f"--agent runs only -m {__spec__.name}, got {args.training_script!r}")
    args.start_method = "fork"
    config, _cmd, _cmd_args = config_from_args(args)
    # The preload every forked worker inherits. torch._dynamo: DDP's constructor imports it (and so
    # does torch's log formatter for any traceback, e.g. the agent's report of a dead worker).
    import torch._dynamo  # noqa: F401

    _preload_trainer(list(args.training_script_args))
    _warm_data_path(list(args.training_script_args))
    _fast_rendezvous_polling()
    if config.min_nodes < config.max_nodes:
        _whole_first_gang()
    try:
        elastic_launch(config=config, entrypoint=forked_worker)(*args.training_script_args)
    except ChildFailedError as exc:
        print(f"[agent] worker group failed and the restarts are spent: {exc}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:  # the launcher ending the job (torch has stopped the workers)
        print(f"[agent] stopped by signal {exc.sigval}", file=sys.stderr, flush=True)
        return 1  # the status an uncaught exception gave, which is what the launcher reads
    return 0


if __name__ == "__main__":
    sys.exit(main())
