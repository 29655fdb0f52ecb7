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

Mixtures: given several ``LoaderSource`` (name, weight, ``PackedTokens``) instead of one
``PackedTokens``, the loader draws each position through ``kiln_trainer.mixture.Mixture`` (seed,
weights, the sources' shard sizes): ``draw(rank_positions(...))`` says which source and which of its
samples each of this rank's positions is; the rows are read in one call over every source's shards
(``ConcatenatedTokens`` of the global ids), each source's from its own ``PackedTokens``. The ids
(``sample_ids``, the sample log) are the mixture's global ids (the sources' samples concatenated in
declared order), the same at every world size. The state
adds ``sources`` (name, weight and token manifest sha256 of each: part of the identity a resume
checks; ``token_manifest_sha256`` is then ``mixture_tokens_sha256`` of them) and ``mixture``
(``Mixture.state_dict``: per source the draws made and the epoch reached), and a resume checks it
with ``Mixture.resume``. ``mixture_report`` and ``mixture_metrics`` give each source's draws,
epoch and realized share. One source (one ``PackedTokens``, or one ``LoaderSource``) is the plain
order above, unchanged. A ``LoaderSource``'s ``max_epochs`` / ``max_tokens`` cap it: ``cap_stop``
is the first global batch that would draw it past a cap (``Mixture.cap_step``), where the session
ends the run; the loader itself draws on (its prefetch reads ahead).

Read-ahead: a background thread reads ``read_steps`` steps at a time -- their positions' ids in one
call of the order (or the mixture), their rows in one read of each shard they touch -- whenever
fewer than ``prefetch_steps`` steps are ready; so it wakes once per ``read_steps`` steps, not once
a step, and at most ``prefetch_steps - 1 + read_steps`` steps are held (bounded, whatever the corpus
size). A block whose build fails is built again step by step, so an error (a shard cut or altered
since it was checked) reaches ``next_step`` at the step it belongs to, after the steps before it,
and is raised in the training thread as the read raised it. ``state_dict`` counts only the steps
handed out by ``next_step``: the read-ahead never moves the state, and a resume (or ``skip_step``)
starts a new read-ahead at the state's position, so the batches depend on the position alone, never
on where a block began. ``sample_log`` (a path) makes the loader append one JSON line per step with
the global sample ids this rank read -- the record the world-size proofs compare.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln_trainer.contract.training_manifest import metric_name, mixture_tokens_sha256
from kiln_trainer.errors import BlockSizeMismatchError, RecipeError, ResumeMismatchError
from kiln_trainer.mixture import QUOTA_DENOMINATOR, Mixture, MixtureSource
from kiln_trainer.packed import ConcatenatedTokens, PackedTokens
from kiln_trainer.sample_order import SampleOrder

__all__ = ["LOADER_STATE_KIND", "LoaderSource", "StepBatch", "TokenLoader", "rank_positions"]

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
    sources: np.ndarray | None = None
    """A mixture's: int64 ``[accum_steps * b]``, the source (declared index) of each sample; None for one source."""


@dataclass(frozen=True, slots=True)
class LoaderSource:
    """One source of a mixed loader: its name and weight in the mixture, its packed tokens, and its
    caps (the training manifest's ``max_epochs`` and ``max_tokens``; None: it recycles by epochs)."""

    name: str
    weight: float
    tokens: PackedTokens
    max_epochs: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CapStop:
    """Where a capped source ends the run: the first global batch (``step``, 0-based, counted in the
    loader's batches: the guard's skipped ones included) that would draw ``source`` past ``limit``
    (``max_epochs = 2`` or ``max_tokens = N``), i.e. past ``draws`` samples of it."""

    step: int
    source: str
    limit: str
    draws: int

    def to_json(self) -> dict[str, Any]:
        return {"reason": "mixture_cap", "source": self.source, "limit": self.limit, "draws": self.draws,
                "loader_step": self.step}


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
    """Steps of one rank over ``PackedTokens`` in ``SampleOrder`` (or over a mixture of sources, each
    in its own order, drawn by weight); the state is a few integers."""

    def __init__(
        self,
        tokens: PackedTokens | Sequence[LoaderSource],
        *,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        window_shards: int = 0,
        prefetch_steps: int = 2,
        read_steps: int = 8,
        sample_log: str | Path | None = None,
    ) -> None:
        self.accum_steps = _check_geometry(global_batch_size, micro_batch_size, rank, world_size)
        for name, value in (("prefetch_steps", prefetch_steps), ("read_steps", read_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RecipeError(f"{name} = {value!r}: must be an int >= 1")
        self.sources: tuple[LoaderSource, ...] = (
            (LoaderSource("", 1.0, tokens),) if isinstance(tokens, PackedTokens) else tuple(tokens))
        """Every source, in declared order (one nameless source for a plain ``PackedTokens``)."""
        if not self.sources:
            raise RecipeError("a loader needs packed tokens: no source given")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.order = SampleOrder(self.sources[0].tokens.shard_samples, seed=seed, window_shards=window_shards)
        """The plain order (one source); a mixture draws through ``mixture`` instead."""
        self.mixture: Mixture | None = None
        if len(self.sources) > 1:
            first = self.sources[0]
            for source in self.sources[1:]:
                if source.tokens.sample_tokens != first.tokens.sample_tokens:
                    raise BlockSizeMismatchError(
                        f"source {source.name!r}'s samples are {source.tokens.sample_tokens} tokens, {first.name!r}'s "
                        f"{first.tokens.sample_tokens}: a mixture's sources must be packed with one block size")
            self.mixture = Mixture([MixtureSource(s.name, s.weight, s.tokens.shard_samples) for s in self.sources],
                                   seed=seed, window_shards=window_shards)
            self._concatenated = ConcatenatedTokens([s.tokens for s in self.sources])
        self.cap_stop = self._cap_stop()
        """Where a capped source ends the run (None: no source has a cap); the same at every world size."""
        self.prefetch_steps = prefetch_steps
        """The read-ahead thread reads when fewer steps than this are ready."""
        self.read_steps = read_steps
        """Steps the read-ahead thread reads per wake-up."""
        self.sample_log = Path(sample_log) if sample_log is not None else None
        self.consumed_samples = 0
        self._ahead: _ReadAhead | None = None

    def _cap_stop(self) -> CapStop | None:
        block = self.sources[0].tokens.sample_tokens - 1  # the tokens a sample trains, as mixture_report counts
        sizes = self.mixture.num_samples if self.mixture is not None else (self.order.num_samples,)
        caps: list[tuple[int, str] | None] = []
        for i, (source, size) in enumerate(zip(self.sources, sizes, strict=True)):
            limits = []
            for key, value in (("max_epochs", source.max_epochs), ("max_tokens", source.max_tokens)):
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise RecipeError(f"sources[{i}] ({source.name!r}).{key} = {value!r}: must be an int >= 1 (None: no cap)")
                limits.append((value * size if key == "max_epochs" else value // block, f"{key} = {value}"))
            caps.append(min(limits) if limits else None)
        if all(cap is None for cap in caps):
            return None
        draws_caps = [cap[0] if cap else None for cap in caps]
        if self.mixture is not None:
            found = self.mixture.cap_step(draws_caps, self.global_batch_size)
        else:  # one source: its k-th draw is position k
            found = None if draws_caps[0] is None else (draws_caps[0] // self.global_batch_size, 0)
        assert found is not None
        step, j = found
        cap = caps[j]
        assert cap is not None
        draws, limit = cap
        if step == 0:
            raise RecipeError(f"source {self.sources[j].name!r}: its cap {limit} ({draws} samples) is reached within "
                              f"the first global batch of {self.global_batch_size}: nothing could be trained; raise it")
        return CapStop(step=step, source=self.sources[j].name, limit=limit, draws=draws)

    @property
    def tokens(self) -> PackedTokens:
        """The packed tokens of a one-source loader (a mixture has ``sources``)."""
        if self.mixture is not None:
            raise RecipeError("a mixture's loader reads several packed token sets: see its sources")
        return self.sources[0].tokens

    @property
    def num_samples(self) -> int:
        """Samples of every source together."""
        return sum(s.tokens.num_samples for s in self.sources)

    @property
    def token_manifest_sha256(self) -> str:
        """What names the packed tokens read: the token manifest's sha256, or for a mixture
        ``mixture_tokens_sha256`` of every source's name, weight and token manifest sha256."""
        if self.mixture is None:
            return self.sources[0].tokens.manifest.sha256
        return mixture_tokens_sha256([(s.name, s.weight, s.tokens.manifest.sha256) for s in self.sources])

    # ------------------------------------------------------------------ state

    def _identity(self) -> dict[str, Any]:
        identity: dict[str, Any] = {
            "seed": self.order.seed,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.order.num_samples if self.mixture is None else self.num_samples,
            "window_shards": self.order.window_shards,
            "token_manifest_sha256": self.token_manifest_sha256,
        }
        if self.mixture is not None:
            identity["sources"] = [{"name": s.name, "weight": float(s.weight),
                                    "token_manifest_sha256": s.tokens.manifest.sha256} for s in self.sources]
        return identity

    def state_dict(self) -> dict[str, Any]:
        state = {"kind": LOADER_STATE_KIND, "format": 1, "consumed_samples": self.consumed_samples, **self._identity()}
        if self.mixture is not None:
            state["mixture"] = self.mixture.state_dict(self.consumed_samples)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != LOADER_STATE_KIND:
            raise ResumeMismatchError(f"loader state is not a {LOADER_STATE_KIND!r}: {state!r:.200}")
        mine = self._identity()
        keys = _STATE_IDENTITY if self.mixture is None else (*_STATE_IDENTITY, "sources")
        differs = [f"{k}: checkpoint {state.get(k)!r:.300}, now {mine[k]!r:.300}" for k in keys if state.get(k) != mine[k]]
        if differs:
            raise ResumeMismatchError("the checkpoint's data order cannot continue here: " + "; ".join(differs))
        consumed = state.get("consumed_samples")
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise ResumeMismatchError(f"loader state consumed_samples = {consumed!r}: must be an int >= 0")
        if self.mixture is not None:
            mixed = self.mixture.resume(state.get("mixture") or {})  # a missing or malformed one is refused there
            if mixed != consumed:
                raise ResumeMismatchError(f"loader state consumed_samples = {consumed}, but its mixture state "
                                          f"says {mixed}: the state was edited")
        self._stop_prefetch()
        self.consumed_samples = consumed

    @property
    def epoch(self) -> int:
        """The epoch of the next sample (a mixture's: within the source that sample is drawn from)."""
        return self._epoch_at(self.consumed_samples)

    def _epoch_at(self, position: int) -> int:
        if self.mixture is None:
            return self.order.epoch_of(position)
        source, draw = self.mixture.locate(position)  # no permutation needed
        return draw // self.mixture.num_samples[source]

    @property
    def step(self) -> int:
        """Global batches consumed so far."""
        return self.consumed_samples // self.global_batch_size

    # ------------------------------------------------------------------ what a mixture drew

    def mixture_report(self, skipped_batches: Sequence[int] = ()) -> list[dict[str, Any]] | None:
        """Per source of a mixture (None for one source), after ``consumed_samples``: ``name``,
        ``weight`` (declared) and ``weight_share`` (its share of the weights, as drawn: quota / 2**24),
        ``drawn`` (positions drawn from it, skipped batches included), ``epoch`` (of its next draw),
        ``share`` (realized: ``drawn / consumed_samples``), ``trained_samples`` and ``tokens`` (the
        predicted tokens of those samples, ``block_size`` each) without the global batches in
        ``skipped_batches`` (the guard's), and ``token_manifest_sha256``."""
        if self.mixture is None:
            return None
        mix, consumed, g = self.mixture, self.consumed_samples, self.global_batch_size
        drawn = np.array(mix.drawn(consumed), dtype=np.int64)
        skipped = np.zeros_like(drawn)
        for batch in sorted({int(b) for b in skipped_batches}):
            if (batch + 1) * g <= consumed:
                skipped += np.array(mix.drawn((batch + 1) * g), dtype=np.int64) - np.array(mix.drawn(batch * g), dtype=np.int64)
        block = self.sources[0].tokens.sample_tokens - 1
        return [
            {"name": s.name, "weight": float(s.weight), "weight_share": q / QUOTA_DENOMINATOR, "drawn": int(d),
             "epoch": int(d) // n, "share": int(d) / consumed if consumed else 0.0, "trained_samples": int(d - k),
             "tokens": int(d - k) * block, "token_manifest_sha256": s.tokens.manifest.sha256}
            for s, q, n, d, k in zip(self.sources, mix.quotas, mix.num_samples, drawn, skipped, strict=True)
        ]

    def mixture_metrics(self) -> dict[str, float]:
        """A mixture's per-source counts as metric series (empty for one source):
        ``mixture_share_<name>`` (realized), ``mixture_drawn_<name>`` and ``mixture_epoch_<name>``, the
        name in Prometheus' alphabet (``metric_name``)."""
        report = self.mixture_report()
        if report is None:
            return {}
        out: dict[str, float] = {}
        for entry in report:
            key = metric_name(entry["name"])
            out |= {f"mixture_share_{key}": entry["share"], f"mixture_drawn_{key}": entry["drawn"],
                    f"mixture_epoch_{key}": entry["epoch"]}
        return out

    # ------------------------------------------------------------------ order

    def global_batch_ids(self, consumed_before: int | None = None) -> np.ndarray:
        """The G sample ids of the global batch that starts at ``consumed_before`` (default: the next)."""
        start = self.consumed_samples if consumed_before is None else consumed_before
        if self.mixture is not None:
            return self.mixture.draw_range(start, self.global_batch_size).global_ids
        return self.order.ids_range(start, self.global_batch_size)

    def _build(self, consumed: int, steps: int = 1) -> list[StepBatch]:
        """This rank's parts of the ``steps`` global batches from ``consumed`` on: the ids of all their
        positions in one call of the order (or the mixture), their rows in one read."""
        g = self.global_batch_size
        positions = rank_positions(consumed, global_batch_size=g, rank=self.rank, world_size=self.world_size)
        if steps > 1:
            positions = (positions[None, :] + g * np.arange(steps, dtype=np.int64)[:, None]).reshape(-1)
        sources = None
        if self.mixture is None:
            ids = self.order.ids(positions)
            rows = self.tokens.read(ids)
        else:
            drawn = self.mixture.draw(positions)
            ids, sources = drawn.global_ids, drawn.sources
            rows = self._concatenated.read(ids)  # the global ids: every source's shards in one read
        def split(a: np.ndarray) -> list[np.ndarray]:  # each step in arrays of its own, freed when it is dropped
            return [part.copy() for part in np.split(a, steps)] if steps > 1 else [a]

        step_ids, step_rows = split(ids), split(rows)
        step_sources: list[np.ndarray | None] = [*split(sources)] if sources is not None else [None] * steps
        b = self.micro_batch_size
        return [
            StepBatch(
                step=(consumed + k * g) // g,
                consumed_before=consumed + k * g,
                epoch=self._epoch_at(consumed + k * g),
                sample_ids=step_ids[k],
                micro_batches=tuple(step_rows[k][m * b : (m + 1) * b] for m in range(self.accum_steps)),
                sources=step_sources[k],
            )
            for k in range(steps)
        ]

    def _read_block(self, consumed: int) -> list[tuple[str, Any]]:
        """What the read-ahead hands over for the ``read_steps`` steps from ``consumed``: a batch per
        step; if the block's build fails, the steps are built one by one, up to the first that fails,
        whose error ends the list (the error then belongs to its step, as a step-at-a-time read gives it)."""
        try:
            return [("batch", batch) for batch in self._build(consumed, self.read_steps)]
        except BaseException:  # found again below, at its own step
            pass
        items: list[tuple[str, Any]] = []
        for k in range(self.read_steps):
            try:
                items.append(("batch", self._build(consumed + k * self.global_batch_size)[0]))
            except BaseException as exc:  # handed to the training thread, which raises it
                items.append(("error", exc))
                break
        return items

    # ------------------------------------------------------------------ stepping

    def next_step(self) -> StepBatch:
        """This rank's part of the next global batch (read ahead); advances the state by G samples."""
        if self._ahead is None:
            self._ahead = _ReadAhead(self._read_block, self.consumed_samples, self.global_batch_size,
                                     ready_below=self.prefetch_steps, name=f"kiln-loader-r{self.rank}")
        kind, item = self._ahead.get()
        if kind == "error":
            self._stop_prefetch()
            raise item
        batch: StepBatch = item
        assert batch.consumed_before == self.consumed_samples, "read-ahead out of step with the loader state"
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

    def _stop_prefetch(self) -> None:
        if self._ahead is None:
            return
        self._ahead.stop()
        self._ahead = None

    def close(self) -> None:
        self._stop_prefetch()

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ReadAhead:
    """The read-ahead thread and what it has read: items (``("batch", StepBatch)`` or a last
    ``("error", exc)``) from ``read(consumed)``, a block of steps a call, from ``start`` on. The thread
    reads while fewer than ``ready_below`` items are ready and sleeps otherwise; ``get`` wakes it only
    when it takes the ready count below that mark, so the thread wakes once per block."""

    def __init__(self, read: Callable[[int], list[tuple[str, Any]]], start: int, step_samples: int, *,
                 ready_below: int, name: str) -> None:
        self._read, self._step_samples, self._ready_below = read, step_samples, ready_below
        self._items: deque[tuple[str, Any]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._stopped = False
        self._thread = threading.Thread(target=self._run, args=(start,), name=name, daemon=True)
        self._thread.start()

    def get(self) -> tuple[str, Any]:
        with self._cond:
            while not self._items:
                if not self._thread.is_alive() and not self._items:
                    raise RuntimeError(f"the loader's read-ahead thread {self._thread.name} ended without "
                                       "handing over a batch or an error")
                self._cond.wait(timeout=1.0)
            item = self._items.popleft()
            if len(self._items) == self._ready_below - 1:
                self._cond.notify()  # the thread sleeps until now: read the next block
            return item

    def _run(self, consumed: int) -> None:
        while True:
            with self._cond:
                while not self._stopped and len(self._items) >= self._ready_below:
                    self._cond.wait()
                if self._stopped:
                    return
            items = self._read(consumed)
            with self._cond:
                self._items.extend(items)
                self._cond.notify()
            if not items or items[-1][0] == "error":
                return
            consumed += len(items) * self._step_samples

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()
