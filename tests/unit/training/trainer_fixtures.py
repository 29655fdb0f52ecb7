"""Fixtures for the trainer tests: real parquet shards built from the Python stdlib's own source,
a TrainingManifest in kiln's wire format, and helpers that launch the trainer as real processes.

Imported by the tests as ``trainer_fixtures`` (pytest puts this directory on sys.path)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "training" / "recipes"
TINY = RECIPES / "tiny.toml"


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stdlib_sources(limit_bytes: int, skip: int = 0) -> list[tuple[str, str]]:
    """(name, text) of stdlib .py files in a fixed order, totalling about ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py"))[skip:]:
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append((path.name, text))
        total += len(text.encode("utf-8"))
        if total >= limit_bytes:
            break
    return out


def write_shard(path: Path, docs: list[tuple[str, str]]) -> dict[str, Any]:
    table = pa.table(
        {
            "doc_id": [name for name, _ in docs],
            "text": [text for _, text in docs],
            "source": ["stdlib"] * len(docs),
        }
    )
    pq.write_table(table, path)
    return {"path": str(path), "sha256": _sha256(path), "rows": len(docs)}


def write_training_manifest(path: Path, shards: list[dict], eval_shards: list[dict], **extra: Any) -> Path:
    body = {
        "snapshot_id": "0123456789abcdef0123456789abcdef.dir",
        "corpus": "stdlib-py",
        "contract": "stdlib-py@1",
        "shards": shards,
        "eval_shards": eval_shards,
        "quarantined": [],
        **extra,
    }
    doc = {"kind": "kiln.TrainingManifest", **body, "sha256": hashlib.sha256(canonical_json(body)).hexdigest()}
    path.write_text(json.dumps(doc, indent=1))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def train_cmd(
    manifest: Path, run_dir: Path, *overrides: str, recipe: Path = TINY, max_steps: int | None = None
) -> list[str]:
    cmd = ["-m", "kiln_trainer.train", "--manifest", str(manifest), "--recipe", str(recipe), "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    return cmd


def torchrun_cmd(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def two_agent_cmds(args: list[str], rdzv_id: str) -> list[list[str]]:
    port = free_port()
    base = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
    ]
    return [base + args, base + args]


def run_ok(cmd: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or trainer_env(), cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(
            f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return proc


def read_result(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "result.json").read_text())


FIXTURE_MODEL = ("model.n_layer=1", "model.n_head=1", "model.n_embd=8", "model.block_size=8", "optim.warmup_steps=0")
"""The recipe of the checkpoints write_checkpoints makes (a model small enough to write in ms)."""


def write_checkpoints(
    run_dir: Path, steps: list[int], world_size: int = 1, keep_last: int = 10, *, tokenizer: Any = None,
    overrides: tuple[str, ...] = (),
) -> Any:
    """Real checkpoints of a tiny model, written synchronously by the production writer (the byte
    tokenizer unless ``tokenizer`` is given, with ``overrides`` naming it in the recipe)."""
    import torch

    from kiln_trainer.checkpoint import CheckpointIdentity, CheckpointWriter, _torch_save_bytes, capture_rng_state
    from kiln_trainer.config import load_recipe
    from kiln_trainer.model import GPT
    from kiln_trainer.tokenizer import ByteTokenizer

    recipe = load_recipe(None, (*FIXTURE_MODEL, *overrides))
    writer = CheckpointWriter(
        run_dir,
        CheckpointIdentity(
            world_size=world_size,
            recipe=recipe.to_dict(),
            recipe_sha256=recipe.sha256,
            snapshot_id="abc.dir",
            training_manifest_sha256="0" * 64,
            token_manifest_sha256="1" * 64,
            tokenizer=tokenizer or ByteTokenizer(),
        ),
        keep_last=keep_last,
        async_save=False,
    )
    torch.manual_seed(0)
    model = GPT(recipe.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    rng = _torch_save_bytes(capture_rng_state())
    for step in steps:
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
        optimizer.step()
        scheduler.step()
        writer.save(
            step=step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            trainer_state={"step": step},
            rng_blobs=[rng] * world_size,
        )
    writer.close()
    return writer


SHORT = (
    "train.steps=24",
    "checkpoint.every_steps=8",
    "train.log_every=4",
    "optim.warmup_steps=4",
    "checkpoint.keep_last=2",
)
"""Overrides that shrink the tiny recipe to a few seconds: 24 steps, a checkpoint every 8."""

THREADS = {"KILN_TORCH_THREADS": "1"}
"""One torch thread per rank in every test: fast on a shared 2-core box, and the same bits each run."""


def descendants(pid: int) -> list[int]:
    """All descendant pids (Linux /proc): torchrun starts its workers in their own sessions."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out.append(child)
            todo.append(child)
    return out


def sigkill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it, as a node loss would."""
    import signal

    victims = [proc.pid, *descendants(proc.pid)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


@contextlib.contextmanager
def group_of_one():
    """A gloo process group of this process alone (an in-process store), destroyed afterwards: what
    FSDP2 and DCP need to shard and save without torchrun."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def write_sharded_checkpoints(
    run_dir: Path, steps: list[int], *, keep_last: int = 10, async_save: bool = True,
    snapshot_id: str = "abc.dir", training_manifest_sha256: str = "0" * 64, before_save: Any = None,
) -> Any:
    """Real format-3 checkpoints of a tiny FSDP2 model (one rank, in this process), written by the
    trainer's own ShardedCheckpointWriter after a real optimizer step each (``before_save(step)``
    runs just before each save)."""
    import torch

    from kiln_trainer.checkpoint import CheckpointIdentity, _torch_save_bytes, capture_rng_state
    from kiln_trainer.config import load_recipe
    from kiln_trainer.distributed import DistEnv
    from kiln_trainer.model import GPT
    from kiln_trainer.optim import make_optimizer
    from kiln_trainer.parallel import shard_model
    from kiln_trainer.sharded_checkpoint import ShardedCheckpointWriter
    from kiln_trainer.tokenizer import ByteTokenizer

    recipe = load_recipe(None, (*FIXTURE_MODEL, "parallel.strategy=fsdp"))
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    identity = CheckpointIdentity(world_size=1, recipe=recipe.to_dict(), recipe_sha256=recipe.sha256,
                                  snapshot_id=snapshot_id, training_manifest_sha256=training_manifest_sha256,
                                  token_manifest_sha256="1" * 64, tokenizer=ByteTokenizer())
    with group_of_one():
        torch.manual_seed(0)
        model = GPT(recipe.model)
        shard_model(model, recipe, env)
        optimizer = make_optimizer(model, recipe.optim)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
        writer = ShardedCheckpointWriter(run_dir, identity, keep_last=keep_last, async_save=async_save, env=env)
        rng = _torch_save_bytes(capture_rng_state())
        for step in steps:
            model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
            optimizer.step()
            scheduler.step()
            if before_save is not None:
                before_save(step)
            writer.save(step=step, model=model, optimizer=optimizer, scheduler=scheduler,
                        trainer_state={"step": step}, rng_blobs=[rng])
        writer.close()
    return writer
