"""The streaming loader: global batches that do not depend on the world size, read per rank.

::

    tokens = PackedTokens(load_token_manifest(dir))             # or a remote store (kiln_trainer.remote)
    loader = TokenLoader(tokens, global_batch_size=G, micro_batch_size=b,
                         rank=r, world_size=W, seed=recipe_seed)
    loader.load_state_dict(ckpt["loader"])                      # on resume, at any world size
    batch = loader.next_step()                                  # this rank's part of the next global batch
    for mb in batch.micro_batches:                              # accum_steps = G // (W * b) of them
        x, y = torch.from_numpy(mb[:, :-1]), torch.from_numpy(mb[:, 1:])
    ckpt["loader"] = loader.state_dict()                        # tiny: counters + identity
    loader.skip_step()                                          # the loss guard drops a global batch

Order: the stream positions of optimizer step ``s`` (0-based, with ``c0`` samples consumed
before it) are ``[c0 + s*G, c0 + (s+1)*G)``; ``SampleOrder`` maps them to sample ids (a seeded
bijection per epoch). The global batch is therefore the same set of ids, in the same order, at
every world size. Rank ``r`` takes the contiguous slice ``[r*G/W, (r+1)*G/W)`` of it, as
``accum_steps`` micro-batches of ``b`` samples, and reads only those rows. Gradient accumulation
is how the world size changes while ``G`` stays fixed: ``accum_steps = G / (W*b)``, so ``G``
must divide by ``W*b``. Every sample has exactly ``block_size+1`` tokens (no padding), so the
mean loss over the global batch -- and its gradient -- is the same whatever ``W`` and ``b`` are
(up to float summation order).

State: ``{"consumed_samples", "seed", "global_batch_size", "num_samples", "window_shards",
"token_manifest_sha256"}``; the epoch is ``consumed_samples // num_samples``. Restoring it at any
world size continues the same global sequence; a state from other shards, seed, batch size or
order is refused (``ResumeMismatchError``).

Prefetch: a background thread reads the next ``prefetch_steps`` steps into a bounded queue;
``state_dict`` counts only the steps handed out by ``next_step``. ``sample_log`` (a path) makes
the loader append one JSON line per step with the global sample ids this rank read -- the record
the world-size proofs compare.
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln_trainer.errors import RecipeError, ResumeMismatchError
from kiln_trainer.packed import PackedTokens
from kiln_trainer.sample_order import SampleOrder

__all__ = ["LOADER_STATE_KIND", "StepBatch", "TokenLoader", "rank_positions"]

LOADER_STATE_KIND = "kiln.LoaderState"
_STATE_IDENTITY = ("seed", "global_batch_size", "num_samples", "window_shards", "token_manifest_sha256")


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One rank's part of one global batch."""

    step: int
    """0-based index of the global batch in the run (``consumed_before // G``)."""
    consumed_before: int
    """Stream position of the global batch's first sample."""
    epoch: int
    """Epoch of the first sample (a global batch may straddle two epochs)."""
    sample_ids: np.ndarray
    """int64 ``[accum_steps * b]``: the global sample ids this rank read, micro-batch after micro-batch."""
    micro_batches: tuple[np.ndarray, ...]
    """``accum_steps`` int64 arrays ``[b, block_size+1]``."""


def rank_positions(consumed: int, *, global_batch_size: int, rank: int, world_size: int) -> np.ndarray:
    """Stream positions of rank ``rank``'s contiguous part of the global batch starting at ``consumed``."""
    share = global_batch_size // world_size
    start = consumed + rank * share
    return np.arange(start, start + share, dtype=np.int64)


def _check_geometry(global_batch_size: int, micro_batch_size: int, rank: int, world_size: int) -> int:
    sizes = {"global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size, "world_size": world_size}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RecipeError(f"{name} = {value!r}: must be an int >= 1")
    if not 0 <= rank < world_size:
        raise RecipeError(f"rank = {rank}: must be in [0, world_size={world_size})")
    if global_batch_size % (world_size * micro_batch_size):
        raise RecipeError(
            f"global_batch_size = {global_batch_size} must divide by world_size x micro_batch_size "
            f"= {world_size} x {micro_batch_size} (each rank runs G / (W x b) micro-batches per step)"
        )
    return global_batch_size // (world_size * micro_batch_size)


class TokenLoader:
    """Steps of one rank over ``PackedTokens`` in ``SampleOrder``; the state is a few integers."""

    def __init__(
        self,
        tokens: PackedTokens,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        window_shards: int = 0,
        prefetch_steps: int = 2,
        sample_log: str | Path | None = None,
    ) -> None:
        self.accum_steps = _check_geometry(global_batch_size, micro_batch_size, rank, world_size)
        if prefetch_steps < 1:
            raise RecipeError(f"prefetch_steps = {prefetch_steps}: must be >= 1")
        self.tokens = tokens
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.order = SampleOrder(tokens.shard_samples, seed=seed, window_shards=window_shards)
        self.prefetch_steps = prefetch_steps
        self.sample_log = Path(sample_log) if sample_log is not None else None
        self.consumed_samples = 0
        self._queue: queue.Queue[tuple[str, Any]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ state

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.order.seed,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.order.num_samples,
            "window_shards": self.order.window_shards,
            "token_manifest_sha256": self.tokens.manifest.sha256,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"kind": LOADER_STATE_KIND, "format": 1, "consumed_samples": self.consumed_samples, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != LOADER_STATE_KIND:
            raise ResumeMismatchError(f"loader state is not a {LOADER_STATE_KIND!r}: {state!r:.200}")
        mine = self._identity()
        differs = [f"{k}: checkpoint {state.get(k)!r}, now {mine[k]!r}" for k in _STATE_IDENTITY if state.get(k) != mine[k]]
        if differs:
            raise ResumeMismatchError("the checkpoint's data order cannot continue here: " + "; ".join(differs))
        consumed = state.get("consumed_samples")
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise ResumeMismatchError(f"loader state consumed_samples = {consumed!r}: must be an int >= 0")
        self._stop_prefetch()
        self.consumed_samples = consumed

    @property
    def epoch(self) -> int:
        return self.order.epoch_of(self.consumed_samples)

    @property
    def step(self) -> int:
        """Global batches consumed so far."""
        return self.consumed_samples // self.global_batch_size

    # ------------------------------------------------------------------ order

    def global_batch_ids(self, consumed_before: int | None = None) -> np.ndarray:
        """The G sample ids of the global batch that starts at ``consumed_before`` (default: the next)."""
        start = self.consumed_samples if consumed_before is None else consumed_before
        return self.order.ids_range(start, self.global_batch_size)

    def _build(self, consumed: int) -> StepBatch:
        positions = rank_positions(consumed, global_batch_size=self.global_batch_size, rank=self.rank, world_size=self.world_size)
        ids = self.order.ids(positions)
        rows = self.tokens.read(ids)
        b = self.micro_batch_size
        micro = tuple(rows[m * b : (m + 1) * b] for m in range(self.accum_steps))
        return StepBatch(
            step=consumed // self.global_batch_size,
            consumed_before=consumed,
            epoch=self.order.epoch_of(consumed),
            sample_ids=ids,
            micro_batches=micro,
        )

    # ------------------------------------------------------------------ stepping

    def next_step(self) -> StepBatch:
        """This rank's part of the next global batch (prefetched); advances the state by G samples."""
        if self._thread is None:
            self._start_prefetch()
        assert self._queue is not None
        kind, item = self._queue.get()
        if kind == "error":
            self._stop_prefetch()
            raise item
        batch: StepBatch = item
        assert batch.consumed_before == self.consumed_samples, "prefetch out of step with the loader state"
        self.consumed_samples += self.global_batch_size
        if self.sample_log is not None:
            self._log(batch)
        return batch

    def skip_step(self) -> None:
        """Advance past the next global batch without training on it (every rank must skip the same)."""
        self._stop_prefetch()
        self.consumed_samples += self.global_batch_size

    def _log(self, batch: StepBatch) -> None:
        assert self.sample_log is not None
        self.sample_log.parent.mkdir(parents=True, exist_ok=True)
        line = {
            "step": batch.step,
            "consumed_before": batch.consumed_before,
            "epoch": batch.epoch,
            "rank": self.rank,
            "world_size": self.world_size,
            "sample_ids": batch.sample_ids.tolist(),
        }
        with open(self.sample_log, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")

    def _start_prefetch(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch_steps)
        self._thread = threading.Thread(
            target=self._produce,
            args=(self.consumed_samples, self._queue, self._stop),
            name=f"kiln-loader-r{self.rank}",
            daemon=True,
        )
        self._thread.start()

    def _produce(self, consumed: int, out: queue.Queue[tuple[str, Any]], stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item: tuple[str, Any] = ("batch", self._build(consumed))
            except BaseException as exc:  # handed to the training thread, which raises it
                item = ("error", exc)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] == "error":
                return
            consumed += self.global_batch_size

    def _stop_prefetch(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread, self._queue = None, None

    def close(self) -> None:
        self._stop_prefetch()

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
