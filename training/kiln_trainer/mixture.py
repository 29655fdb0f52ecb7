"""The draw of a data mixture: which source, and which of its samples, each stream position trains on.

A mixture is several sources (corpora packed with the run's one tokenizer), each with a weight.
The training stream is the loader's sequence of positions 0, 1, 2, ... (``loader.py``: the global
batch of step ``s`` is ``[c0 + sG, c0 + (s+1)G)``, rank ``r`` reads its contiguous slice).
``Mixture.draw(positions)`` maps positions to ``(source, sample of that source)`` as a pure function
of (seed, position, the sources' names, weights and shard sizes, ``window_shards``): never of the
world size, the rank, or what was read before. It is computed per position, vectorised, with no
table: any step of any run is drawn directly, which is what a resume at another world size needs.

::

    mix = Mixture([MixtureSource("web", 0.7, web.shard_samples),
                   MixtureSource("code", 0.2, code.shard_samples),
                   MixtureSource("books", 0.1, books.shard_samples)], seed=recipe_seed)
    d = mix.draw(rank_positions(consumed, global_batch_size=G, rank=r, world_size=W))
    for j in range(len(mix.sources)):           # d.sources[i] = j: read d.samples[i] from source j
        rows_j = tokens[j].read(d.samples[d.sources == j])
    ckpt["mixture"] = mix.state_dict(consumed)  # small JSON; mix.resume(state) gives consumed back

**Which source** (the split). The weights are turned into integer quotas ``q_j`` that sum to
``QUOTA_DENOMINATOR`` = 2**24 (exact rational arithmetic, largest remainder; so
``|q_j / 2**24 - w_j / sum(w)| < 2**-24``; a source whose share rounds to no quota is refused). The
sources, in their declared order, are the leaves of a balanced binary tree; a node whose left
subtree holds quota ``a`` of its total ``t`` sends the ``m``-th position that reaches it left when
``L(m + 1) > L(m)``, with ``L(m) = floor((m*a + floor(t/2)) / t)`` the left count among its first
``m`` positions, and passes on the position's index among those sent the same way. This is a
stratified (Beatty-sequence) split, not an i.i.d. draw, and the shares it gives are exact up to a
bound, with no randomness to average out: among positions ``[0, n)`` source ``j`` gets
``drawn_j(n)`` with ``|drawn_j(n) - n*q_j/2**24| <= depth/2``, ``depth = ceil(log2(#sources))``
(one level's rounding is at most 1/2 and a level passes its parent's error on scaled by at most
1), so any window of positions -- one global batch, 10**4 of them -- holds each source within
``depth`` samples of its share (1 for 2 sources, 2 for 3 or 4; a prefix from position 0 within
half that). Megatron-LM's blended dataset makes the same choice (``build_blending_indices``: a
greedy error-minimising table, built sample after sample); this split gets the same kind of bound
per position, without the table. The
interleave is regular (with 0.9/0.1 every tenth position is the small source); the samples
within each source are shuffled, and the mean loss of a global batch does not depend on where in
the batch a sample sits.

**Which sample** (the source's own order). The ``k``-th draw of source ``j`` (its index among the
positions sent to it, counted from the start of the run) is position ``k`` of the source's own
``SampleOrder`` (a seeded Feistel bijection per epoch, ``sample_order.py``) over its shard sizes,
keyed by a seed derived from (seed, source name) only. So:

* a source runs out by wrapping: draw ``k`` is in the source's epoch ``k // N_j``, and each of its
  epochs is a new permutation of its ``N_j`` samples (each seen once per epoch); how many epochs
  a source is into is ``Mixture.epochs(consumed)`` and is recorded in the state. A cap ("stop
  after 2 epochs of books", a token budget) does not change the draw: it ends the run, at
  ``cap_step`` -- the first global batch that would draw a capped source past its cap;
* adding, removing or reweighting a source, or reordering the list, leaves every other source's
  order unchanged -- its ``k``-th draw is the same sample -- but changes which positions are its
  (their number follows the new shares); renaming a source, or changing its shard sizes, gives it
  a new order;
* a mixture of one source is not the plain ``SampleOrder(seed)`` sequence (its order is keyed by
  the source's name as well).

Sample ids: ``samples`` are ids within a source (0..N_j-1, that source's packed samples in its
token manifest's order), what ``PackedTokens.read`` of that source takes; ``global_ids`` are
``offset_j + sample``, the sources concatenated in declared order, one id space for sample logs.

**State and resume.** The draw is a pure function of the position, so a loader's
``consumed_samples`` is the whole state. ``state_dict(consumed)`` records it with the mixture's
identity (seed, ``window_shards``, and per source name, weight, quota, sample count and a digest of
its shard sizes) and, per source, the draws made (``drawn``) and its epoch, for the lineage and as
a check: ``resume(state)`` refuses a state of another mixture, naming the field
(``ResumeMismatchError``), and a state whose counts this code does not recompute (a changed draw).
Resuming from any state gives, position for position, the ids of an uninterrupted run.

Cost. A loader's step draws a few dozen consecutive draws of each source, and the Feistel
permutation's cost per call is its cycle walking: it runs pass after pass until the element of the
sparsest domain is back in range, each pass a fixed numpy cost. So each source's epoch is permuted in
blocks of ``_BLOCK`` consecutive draws, each block once (one vectorised call, the walk paid once for
4096 ids) and kept (``_BLOCKS_KEPT`` per source, least recently used dropped); a step is then a lookup
per source. Draws that scatter over more than two blocks of a source's epoch (a test's random
positions) are permuted directly, all sources in one vectorised pass (``_permute_direct``). Both give
the permutation's ids: the sequence is the same either way. Measured 2026-12-07 on the shared 2-core
development machine at load 3.6, process CPU, best of 3: drawing 10**4 global batches of 512
positions from 3 sources of 10**7, 3*10**6 and 10**6 samples (``window_shards = 0``) takes 2.1 s
(5.1-5.3 s before the blocks, at load 5-8), about 0.2 ms a step on the loader's prefetch thread, of
which the split is 0.45 s; ``SampleOrder`` over the largest source alone, which walks every call,
takes 4.5 s. With ``window_shards > 0`` each source's ``SampleOrder`` is called in turn.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from kiln_trainer.errors import RecipeError, ResumeMismatchError
from kiln_trainer.sample_order import _MAX_WALK, FeistelPermutation, SampleOrder, _mix64, round_keys

__all__ = ["MIXTURE_STATE_KIND", "QUOTA_DENOMINATOR", "Mixture", "MixtureDraw", "MixtureSource"]

MIXTURE_STATE_KIND = "kiln.MixtureState"
QUOTA_DENOMINATOR = 1 << 24
"""The weights are resolved to quotas out of 2**24 (shares to ~6e-8); the split's integer products
stay below 2**48, far inside int64, for any position."""

_BLOCK = 1 << 12
"""Draws of a source's epoch permuted together and kept (``Mixture._block``): 32 KiB of ids."""
_BLOCKS_KEPT = 3
"""Blocks kept per source (the current one, the next, and the next epoch's first)."""

_ALGORITHM = "binary-split/1"
"""Names the draw; a state written by another draw is refused rather than continued differently."""


@dataclass(frozen=True, slots=True)
class MixtureSource:
    """One source of a mixture: its name (unique in the mixture), weight (relative, > 0) and the
    sample counts of its packed shards, in its token manifest's order."""

    name: str
    weight: float
    shard_samples: tuple[int, ...]

    def __init__(self, name: str, weight: float, shard_samples: Sequence[int]) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "shard_samples", tuple(shard_samples))

    @property
    def num_samples(self) -> int:
        return sum(self.shard_samples)


@dataclass(frozen=True, slots=True)
class MixtureDraw:
    """What a set of stream positions draws; every array has the positions' shape, int64."""

    sources: np.ndarray
    """Index of the source (in the mixture's declared order)."""
    samples: np.ndarray
    """Sample id within that source (0..N_j-1): what that source's ``PackedTokens.read`` takes."""
    draws: np.ndarray
    """The position's index among its source's draws since the start of the run (``k``)."""
    epochs: np.ndarray
    """The source's epoch the sample is drawn in, ``k // N_j``."""
    global_ids: np.ndarray
    """``offset_j + sample``: the sources' samples concatenated in declared order."""


def _field(index: int, source: object, name: str) -> str:
    label = getattr(source, "name", None)
    return f"sources[{index}]" + (f" ({label!r})" if isinstance(label, str) and label else "") + f".{name}"


def _check_sources(sources: Sequence[MixtureSource]) -> tuple[MixtureSource, ...]:
    """The sources, checked: each refusal names the field that is wrong."""
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
        raise RecipeError(f"sources = {sources!r:.100}: must be a list of MixtureSource")
    if not sources:
        raise RecipeError("sources: a mixture needs at least one source, got none")
    seen: dict[str, int] = {}
    checked = []
    for i, source in enumerate(sources):
        if not isinstance(source, MixtureSource):
            raise RecipeError(f"sources[{i}] = {source!r:.100}: must be a MixtureSource")
        name = source.name
        if not isinstance(name, str) or not name.strip():
            raise RecipeError(f"sources[{i}].name = {name!r}: must be a non-empty string")
        if name in seen:
            raise RecipeError(f"sources[{i}].name = {name!r}: duplicate, sources[{seen[name]}] has the same name")
        seen[name] = i
        weight = source.weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise RecipeError(f"{_field(i, source, 'weight')} = {weight!r}: must be a finite number > 0")
        sizes = source.shard_samples
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
            raise RecipeError(f"{_field(i, source, 'shard_samples')} = {list(sizes)[:8]!r}: "
                              "must be one sample count (an int >= 0) per packed shard, at least one shard")
        if sum(sizes) == 0:
            raise RecipeError(f"{_field(i, source, 'shard_samples')}: the source has no samples "
                              f"({len(sizes)} shard(s), all empty): nothing to draw from it")
        checked.append(MixtureSource(name, float(weight), sizes))
    return tuple(checked)


def _quotas(sources: tuple[MixtureSource, ...]) -> tuple[int, ...]:
    """Integer quotas summing to ``QUOTA_DENOMINATOR``, by largest remainder on the exact shares
    (ties to the earlier source); the same floats give the same quotas on every machine."""
    exact = [Fraction(s.weight) for s in sources]
    total = sum(exact, Fraction(0))
    scaled = [w * QUOTA_DENOMINATOR / total for w in exact]
    quotas = [math.floor(x) for x in scaled]
    short = QUOTA_DENOMINATOR - sum(quotas)
    for i in sorted(range(len(scaled)), key=lambda i: (-(scaled[i] - quotas[i]), i))[:short]:
        quotas[i] += 1
    for i, q in enumerate(quotas):
        if q == 0:
            raise RecipeError(
                f"{_field(i, sources[i], 'weight')} = {sources[i].weight!r}: its share of the total "
                f"({float(exact[i] / total):.3g}) is below the mixture's resolution 2**-24; raise it or drop the source"
            )
    return tuple(quotas)


def _digest(sizes: tuple[int, ...]) -> str:
    return hashlib.blake2b(",".join(map(str, sizes)).encode(), digest_size=16).hexdigest()


def _source_seed(seed: int, name: str) -> int:
    """The seed of a source's own order: a stable hash of (seed, name), so no other source bears on it."""
    digest = hashlib.blake2b(f"kiln.mixture-source\x00{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _left_count(m: Any, left: Any, total: Any) -> Any:
    """``floor((m*left + floor(total/2)) / total)`` without forming ``m*left`` (ints or int64 arrays)."""
    whole, rest = divmod(m, total)
    return whole * left + (rest * left + total // 2) // total


class Mixture:
    """Stream positions -> (source, sample of that source); see the module's docstring for the rules."""

    def __init__(self, sources: Sequence[MixtureSource], *, seed: int, window_shards: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise RecipeError(f"seed = {seed!r}: must be an int")
        if isinstance(window_shards, bool) or not isinstance(window_shards, int) or window_shards < 0:
            raise RecipeError(f"window_shards = {window_shards!r}: must be an int >= 0 (0 = one global shuffle per source)")
        self.sources = _check_sources(sources)
        self.seed = seed
        self.window_shards = window_shards
        self.quotas = _quotas(self.sources)
        self.num_samples = tuple(s.num_samples for s in self.sources)
        self.offsets = tuple(int(x) for x in np.cumsum([0, *self.num_samples[:-1]]))
        self.orders = tuple(
            SampleOrder(s.shard_samples, seed=_source_seed(seed, s.name), window_shards=window_shards) for s in self.sources
        )
        self._perms: dict[tuple[int, int], FeistelPermutation] = {}
        self._blocks: tuple[dict[tuple[int, int], np.ndarray], ...] = tuple({} for _ in self.sources)
        """Per source, its kept blocks by (epoch, block), least recently used first."""
        self._lock = threading.Lock()  # the loader's prefetch thread and its caller both draw
        self._build_tree()

    def _build_tree(self) -> None:
        """The split tree as arrays: node 0 is the root; a leaf has ``leaf >= 0`` (its source)."""
        left_quota: list[int] = []
        total: list[int] = []
        children: list[list[int]] = []
        leaf: list[int] = []

        def build(lo: int, hi: int) -> int:
            node = len(leaf)
            left_quota.append(0)
            total.append(sum(self.quotas[lo:hi]))
            children.append([0, 0])
            leaf.append(lo if hi - lo == 1 else -1)
            if hi - lo > 1:
                mid = (lo + hi) // 2
                left_quota[node] = sum(self.quotas[lo:mid])
                children[node] = [build(lo, mid), build(mid, hi)]
            return node

        build(0, len(self.sources))
        self._left = np.array(left_quota, dtype=np.int64)
        self._total = np.array(total, dtype=np.int64)
        self._children = np.array(children, dtype=np.int64)
        self._leaf = np.array(leaf, dtype=np.int64)
        self.depth = math.ceil(math.log2(len(self.sources))) if len(self.sources) > 1 else 0
        self._left_list, self._total_list, self._leaf_list = left_quota, total, leaf  # for locate's Python ints
        self._children_list = [tuple(c) for c in children]

    # ------------------------------------------------------------------ the draw

    def split(self, positions: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(source index, draw index within that source) of each stream position (ints >= 0)."""
        given = np.asarray(positions, dtype=np.int64)
        if given.size and given.min() < 0:
            raise RecipeError("stream positions must be >= 0")
        m = given.reshape(-1).copy()  # rewritten level by level
        node = np.zeros(m.shape, dtype=np.int64)
        for level in range(self.depth):
            # L(m) = whole*a + floor((rest*a + floor(t/2)) / t) with (whole, rest) = divmod(m, t); L(m+1)
            # exceeds it (by 1: a < t) exactly when that remainder r has r + a >= t. One pair of
            # divisions a level instead of two _left_count calls.
            inner: slice | np.ndarray
            if level == 0:  # every position is at the root (an inner node: depth > 0)
                inner, here, mm = slice(None), np.zeros(1, dtype=np.int64), m
            else:
                inner = np.flatnonzero(self._leaf[node] < 0)
                here, mm = node[inner], m[inner]
            left, total = self._left[here], self._total[here]
            whole, rest = np.divmod(mm, total)
            carried, remainder = np.divmod(rest * left + total // 2, total)
            before = whole * left + carried
            goes_left = remainder + left >= total
            m[inner] = np.where(goes_left, before, mm - before)
            node[inner] = np.where(goes_left, self._children[here, 0], self._children[here, 1])
        return self._leaf[node].reshape(given.shape), m.reshape(given.shape)

    def locate(self, position: int) -> tuple[int, int]:
        """``split`` of one position, in Python ints: (source index, draw index within that source)."""
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
            raise RecipeError(f"stream position {position!r}: must be an int >= 0")
        node, m = 0, int(position)
        while self._leaf_list[node] < 0:
            left, total = self._left_list[node], self._total_list[node]
            before = _left_count(m, left, total)
            if _left_count(m + 1, left, total) > before:
                node, m = self._children_list[node][0], before
            else:
                node, m = self._children_list[node][1], m - before
        return self._leaf_list[node], m

    def draw(self, positions: np.ndarray | Sequence[int]) -> MixtureDraw:
        """What the given stream positions train on (any positions, any order, any epoch)."""
        sources, draws = self.split(positions)
        sizes = np.asarray(self.num_samples, dtype=np.int64)
        epochs, within = np.divmod(draws, sizes[sources])
        if self.window_shards == 0:
            samples = self._permute(sources.reshape(-1), epochs.reshape(-1), within.reshape(-1)).reshape(draws.shape)
        else:  # windows: each source's own SampleOrder, one call per source in the draw
            samples = np.empty_like(draws)
            for j in np.unique(sources):
                mine = sources == j
                samples[mine] = self.orders[j].ids(draws[mine])
        offsets = np.asarray(self.offsets, dtype=np.int64)
        return MixtureDraw(sources=sources, samples=samples, draws=draws, epochs=epochs, global_ids=offsets[sources] + samples)

    def _permutation(self, source: int, epoch: int) -> FeistelPermutation:
        """The permutation ``SampleOrder`` uses for this source's epoch (``window_shards = 0``)."""
        perm = self._perms.get((source, epoch))
        if perm is None:
            if len(self._perms) > 4 * len(self.sources):  # only each source's current and next epoch are hot
                self._perms.clear()
            order = self.orders[source]
            perm = self._perms[(source, epoch)] = FeistelPermutation(order.num_samples, round_keys(order.seed, epoch))
        return perm

    def _block(self, source: int, epoch: int, block: int) -> np.ndarray:
        """The ids of draws ``[block*B, (block+1)*B)`` of this source's epoch (``B = _BLOCK``, the last
        block shorter), computed once (by the source's ``FeistelPermutation``: the ids ``_permute_direct``
        gives, and a small source's whole epoch walks by table lookups) and kept: ``_BLOCKS_KEPT`` per source,
        the least recently used dropped (per source, so a small source's short epochs never push out a large
        one's block)."""
        kept, key = self._blocks[source], (epoch, block)
        with self._lock:
            table = kept.pop(key, None)
            if table is not None:
                kept[key] = table  # now the most recently used
        if table is None:
            within = np.arange(block * _BLOCK, min((block + 1) * _BLOCK, self.num_samples[source]), dtype=np.int64)
            table = self._permutation(source, epoch)(within)  # one permutation: its small-domain table walk applies
            table.setflags(write=False)
            with self._lock:
                kept[key] = table
                while len(kept) > _BLOCKS_KEPT:
                    del kept[next(iter(kept))]
        return table

    def _permute(self, sources: np.ndarray, epochs: np.ndarray, within: np.ndarray) -> np.ndarray:
        """Each source's own ``SampleOrder`` ids of (epoch, index within it). A loader's step draws a
        few dozen consecutive draws of each source, so a source's epoch is read through blocks of
        ``_BLOCK`` consecutive draws, each permuted once in one vectorised call and kept
        (``_block``): a step then costs a lookup per source instead of the Feistel rounds and their
        cycle walking (which runs until the element of the sparsest domain is back in range). Draws
        of a (source, epoch) that spread over more than two blocks (a scattered query) are permuted
        directly (``_permute_direct``); both give the same ids, the permutation's."""
        k = len(self.sources)
        out = np.empty(within.shape, dtype=np.int64)
        direct: list[np.ndarray] = []
        for source in range(k):
            idx = np.flatnonzero(sources == source) if k > 1 else np.arange(sources.size)
            if not idx.size:
                continue
            first, last = int(epochs[idx].min()), int(epochs[idx].max())
            for epoch in range(first, last + 1) if last - first < 8 else np.unique(epochs[idx]).tolist():
                mine = idx if first == last else idx[epochs[idx] == epoch]
                if not mine.size:
                    continue
                got = within[mine]
                lo, hi = int(got.min()) // _BLOCK, int(got.max()) // _BLOCK
                if hi - lo > 1:
                    direct.append(mine)
                    continue
                table = self._block(source, epoch, lo)
                if hi > lo:
                    table = np.concatenate([table, self._block(source, epoch, hi)])
                out[mine] = table[got - lo * _BLOCK]
        if direct:
            idx = np.concatenate(direct)
            out[idx] = self._permute_direct(sources[idx], epochs[idx], within[idx])
        return out

    def _permute_direct(self, sources: np.ndarray, epochs: np.ndarray, within: np.ndarray) -> np.ndarray:
        """Each source's own ``SampleOrder`` ids of (epoch, index within it), for every source in one
        vectorised pass: the Feistel rounds of ``FeistelPermutation`` with a key, a width and a range
        per element, so a draw from three sources costs about what one source's order does (a loop of
        ``SampleOrder.ids`` per source pays numpy's per-call cost once per source)."""
        groups, which = np.unique(epochs * len(self.sources) + sources, return_inverse=True)
        perms = [self._permutation(int(g % len(self.sources)), int(g // len(self.sources))) for g in groups]
        keys = np.array([p.keys for p in perms], dtype=np.uint64).T[:, which]  # [rounds, M]: a row per round
        half = np.array([p.half_bits for p in perms], dtype=np.uint64)[which]
        n = np.array([p.n for p in perms], dtype=np.uint64)[which]
        mask = (np.uint64(1) << half) - np.uint64(1)

        def rounds(x: np.ndarray, keys: np.ndarray, half: np.ndarray, mask: np.ndarray) -> np.ndarray:
            left, right = x >> half, x & mask
            for key in keys:
                left, right = right, left ^ (_mix64(right ^ key) & mask)
            return (left << half) | right

        out = rounds(within.astype(np.uint64), keys, half, mask)
        # Cycle walking, as FeistelPermutation does: a value outside [0, n) goes through again. The
        # elements still outside are carried compacted, so each pass costs what is left of them.
        idx = np.flatnonzero(out >= n)
        x, keys, half, mask, n_left = out[idx], keys[:, idx], half[idx], mask[idx], n[idx]
        for _ in range(_MAX_WALK):
            if not idx.size:
                break
            x = rounds(x, keys, half, mask)
            inside = x < n_left
            out[idx[inside]] = x[inside]
            out_ = ~inside
            idx, x, keys, half, mask, n_left = idx[out_], x[out_], keys[:, out_], half[out_], mask[out_], n_left[out_]
        if idx.size:  # only a broken round function gets here (see FeistelPermutation)
            raise RuntimeError(f"cycle walking did not return into range after {_MAX_WALK} rounds: not a permutation")
        out[n == 1] = 0
        return out.astype(np.int64)

    def draw_range(self, start: int, count: int) -> MixtureDraw:
        return self.draw(np.arange(start, start + count, dtype=np.int64))

    # ------------------------------------------------------------------ counts

    def drawn(self, consumed: int) -> tuple[int, ...]:
        """How many of positions ``[0, consumed)`` each source got (exact; O(sources), any size)."""
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise RecipeError(f"consumed = {consumed!r}: must be an int >= 0")
        counts = [0] * len(self.sources)

        def walk(node: int, n: int) -> None:
            if self._leaf[node] >= 0:
                counts[int(self._leaf[node])] = n
                return
            left = _left_count(n, int(self._left[node]), int(self._total[node]))
            walk(int(self._children[node, 0]), left)
            walk(int(self._children[node, 1]), n - left)

        walk(0, consumed)
        return tuple(counts)

    def first_past(self, source: int, cap: int) -> int:
        """The stream position of ``source``'s draw number ``cap`` (0-based): the first position that
        would draw it past ``cap`` draws. Exact, by bisection on ``drawn`` (monotone in the position)."""
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise RecipeError(f"cap = {cap!r}: must be an int >= 0 (draws)")
        lo, hi = 0, 1  # drawn(lo) <= cap < drawn(hi), the answer is hi - 1 once they meet
        while self.drawn(hi)[source] <= cap:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.drawn(mid)[source] <= cap:
                lo = mid
            else:
                hi = mid
        return hi - 1

    def cap_step(self, caps: Sequence[int | None], global_batch_size: int) -> tuple[int, int] | None:
        """Where capped sources stop a run: ``(step, source)``, the first global batch (0-based) that
        would draw a source past its cap and that source (the earliest position when several do), or
        None when no source has a cap. ``caps[j]`` is source ``j``'s most draws (None: no cap). A
        function of the weights, sizes and caps only: the same at every world size."""
        if len(caps) != len(self.sources):
            raise RecipeError(f"caps: one per source ({len(self.sources)}), got {len(caps)}")
        firsts = [(self.first_past(j, cap), j) for j, cap in enumerate(caps) if cap is not None]
        if not firsts:
            return None
        position, source = min(firsts)
        return position // global_batch_size, source

    def epochs(self, consumed: int) -> tuple[int, ...]:
        """Per source, the epoch its next draw is in (whole epochs of it trained after ``consumed``)."""
        return tuple(d // n for d, n in zip(self.drawn(consumed), self.num_samples, strict=True))

    def realized_shares(self, consumed: int) -> tuple[float, ...]:
        """Per source, its share of positions ``[0, consumed)`` (the weights' shares at ``consumed = 0``)."""
        if consumed == 0:
            return tuple(q / QUOTA_DENOMINATOR for q in self.quotas)
        return tuple(d / consumed for d in self.drawn(consumed))

    # ------------------------------------------------------------------ state

    def _identity(self) -> dict[str, Any]:
        return {
            "algorithm": _ALGORITHM,
            "seed": self.seed,
            "window_shards": self.window_shards,
            "quota_denominator": QUOTA_DENOMINATOR,
            "sources": [
                {"name": s.name, "weight": s.weight, "quota": q, "num_samples": n, "shards": len(s.shard_samples),
                 "shard_samples_blake2b": _digest(s.shard_samples)}
                for s, q, n in zip(self.sources, self.quotas, self.num_samples, strict=True)
            ],
        }

    def state_dict(self, consumed: int) -> dict[str, Any]:
        """A small JSON-able record of the mixture after ``consumed`` positions: its identity and, per
        source, the draws made and the epoch reached (the counts lineage reports)."""
        identity = self._identity()
        for entry, drawn, n in zip(identity["sources"], self.drawn(consumed), self.num_samples, strict=True):
            entry["drawn"] = drawn
            entry["epoch"] = drawn // n
        return {"kind": MIXTURE_STATE_KIND, "format": 1, "consumed_samples": consumed, **identity}

    def resume(self, state: Mapping[str, Any]) -> int:
        """The ``consumed_samples`` to continue from, after checking that ``state`` is this mixture's;
        a state of another mixture, or whose counts this draw does not give, is refused naming the field."""
        if not isinstance(state, Mapping) or state.get("kind") != MIXTURE_STATE_KIND or state.get("format") != 1:
            raise ResumeMismatchError(f"mixture state is not a {MIXTURE_STATE_KIND!r} of format 1: {state!r:.200}")
        mine = self._identity()
        differs = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}"
                   for k, v in mine.items() if k != "sources" and state.get(k) != v]
        given = state.get("sources")
        theirs: list[Mapping[str, Any]] = [s if isinstance(s, Mapping) else {} for s in given] if isinstance(given, list) else []
        if not isinstance(given, list) or len(theirs) != len(mine["sources"]):
            names = [s.get("name") for s in theirs] if isinstance(given, list) else given
            differs.append(f"sources: checkpoint {names!r:.200}, now {[s.name for s in self.sources]!r}")
        else:
            for i, (old, new) in enumerate(zip(theirs, mine["sources"], strict=True)):
                differs += [f"sources[{i}].{k}: checkpoint {old.get(k)!r}, now {v!r}" for k, v in new.items() if old.get(k) != v]
        if differs:
            raise ResumeMismatchError("the checkpoint's mixture cannot continue here: " + "; ".join(differs))
        consumed = state.get("consumed_samples")
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise ResumeMismatchError(f"mixture state consumed_samples = {consumed!r}: must be an int >= 0")
        expected = self.state_dict(consumed)["sources"]
        wrong = [f"sources[{i}].{k}: checkpoint {old.get(k)!r}, this draw gives {new[k]!r}"
                 for i, (old, new) in enumerate(zip(theirs, expected, strict=True))
                 for k in ("drawn", "epoch") if old.get(k) != new[k]]
        if wrong:
            raise ResumeMismatchError("the mixture state's counts are not what this draw gives at consumed_samples = "
                                      f"{consumed} (another kiln's draw?): " + "; ".join(wrong))
        return consumed
