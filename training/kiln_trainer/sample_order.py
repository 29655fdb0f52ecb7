"""The order samples are trained in: a seeded bijection per epoch, computed, never stored.

The training stream is a sequence of *positions* 0, 1, 2, ... (position ``p`` is in epoch
``p // N`` for ``N`` samples). ``SampleOrder.ids(positions)`` maps positions to global sample ids
(0..N-1, the packed shards' samples in manifest order). Within one epoch the map is a permutation,
so every sample is seen exactly once per epoch, and it depends only on (shard sizes, seed, epoch,
window) -- never on the world size, the rank or how much was read before. Memory is O(shards),
not O(samples): billions of samples work.

The permutation is a Feistel network over ``[0, 2**k)`` (``k`` even, ``2**k < 4N``) with
cycle walking down to ``[0, n)``: a keyed bijection computed per index, vectorised in numpy,
with an exact inverse (``FeistelPermutation.inverse``) used by the tests.

``window_shards`` trades shuffle quality for locality: 0 shuffles all samples globally; ``w > 0``
shuffles the shard order per epoch, cuts it into windows of ``w`` shards and shuffles the samples
inside each window, so a reader needs only about ``w`` shards at a time (what a bounded remote
cache wants; MosaicML's ``py1b`` and litdata's chunk shuffling make the same trade).

Cost. A call's cost is mostly fixed (the round keys, then pass after pass of cycle walking until
the element of the sparsest domain is back in range, each pass a fixed numpy cost), and a loader
asks for a few dozen consecutive positions at a time. So the ids of an epoch are computed in blocks
of ``_BLOCK`` consecutive positions, each once, and kept (``_BLOCKS_KEPT``, least recently used
dropped); positions that fall in at most two blocks of an epoch are then a lookup. Positions
spread wider (a scattered query) are computed directly. Both are the same map: the ids never
depend on which path gave them. A permutation asked for at least a quarter of a small domain
(``2**k <= _TABLE_DOMAIN``: a block of a corpus of up to ~16k samples, a small mixture source's
epoch) computes the rounds over the whole domain once and walks by table lookups: the walk's passes
then cost an indexing each instead of six rounds of numpy calls.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kiln_trainer.errors import RecipeError

__all__ = ["FeistelPermutation", "SampleOrder", "round_keys"]

FEISTEL_ROUNDS = 6
"""Four rounds of a pseudo-random function already give a pseudo-random permutation (Luby-Rackoff);
six leave a margin for the cheap round function."""

_MAX_WALK = 1000
_TABLE_DOMAIN = 1 << 14
"""The largest domain ``[0, 2**k)`` whose whole round table a walk may compute (128 KiB of int64)."""
_BLOCK = 1 << 12
"""Consecutive positions of an epoch whose ids are computed together and kept (32 KiB of ids)."""
_BLOCKS_KEPT = 3
"""Blocks kept (the current one, the next, and the next epoch's first)."""
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (multiplication wraps mod 2**64, as intended)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def round_keys(*parts: object) -> tuple[int, ...]:
    """``FEISTEL_ROUNDS`` 64-bit keys from a stable hash of ``parts`` (not Python's ``hash``)."""
    digest = hashlib.blake2b(":".join(map(str, ("kiln.sample-order", *parts))).encode(), digest_size=8 * FEISTEL_ROUNDS).digest()
    return tuple(int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(FEISTEL_ROUNDS))


@dataclass(frozen=True, slots=True)
class FeistelPermutation:
    """A keyed bijection of ``[0, n)``; ``perm(x)`` and ``perm.inverse(y)`` take int arrays."""

    n: int
    keys: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.n < 1:
            raise RecipeError(f"a permutation needs n >= 1, got {self.n}")
        if len(self.keys) < 4:
            raise RecipeError(f"a Feistel permutation needs >= 4 round keys, got {len(self.keys)}")

    @property
    def half_bits(self) -> int:
        bits = max(2, (self.n - 1).bit_length())
        return (bits + 1) // 2

    def _rounds(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        half = np.uint64(self.half_bits)
        mask = np.uint64((1 << self.half_bits) - 1)
        left, right = x >> half, x & mask
        keys = [np.uint64(k) for k in self.keys]
        if not inverse:
            for key in keys:
                left, right = right, left ^ (_mix64(right ^ key) & mask)
        else:
            for key in reversed(keys):
                left, right = right ^ (_mix64(left ^ key) & mask), left
        return (left << half) | right

    def _walk(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        if self.n == 1:
            return np.zeros_like(x)
        domain = 1 << 2 * self.half_bits
        if domain <= _TABLE_DOMAIN and 4 * x.size >= domain:
            # The rounds over the whole (small) domain once, then the walk below by lookups in that table:
            # the same values, without the rounds' fixed numpy cost on every pass of the walk.
            table = self._rounds(np.arange(domain, dtype=np.uint64), inverse).astype(np.int64)
            got = table[x]
            outside = got >= self.n
            for _ in range(_MAX_WALK):
                if not outside.any():
                    return got
                got[outside] = table[got[outside]]
                outside = got >= self.n
            raise RuntimeError(f"cycle walking did not return into [0, {self.n}) after {_MAX_WALK} rounds: not a permutation")
        out = self._rounds(x.astype(np.uint64), inverse)
        # Cycle walking: a value outside [0, n) is sent through again; the cycle that starts in
        # [0, n) must come back into it, so this ends, after < 4 rounds on average (2**k < 4n).
        outside = out >= np.uint64(self.n)
        for _ in range(_MAX_WALK):
            if not outside.any():
                return out.astype(np.int64)
            out[outside] = self._rounds(out[outside], inverse)
            outside = out >= np.uint64(self.n)
        # A permutation's walk leaves [n, 2**k) within a few rounds (a walk of 1000 has odds ~(3/4)**1000);
        # only a broken round function gets here.
        raise RuntimeError(f"cycle walking did not return into [0, {self.n}) after {_MAX_WALK} rounds: not a permutation")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self._walk(np.asarray(x, dtype=np.int64), inverse=False)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        return self._walk(np.asarray(y, dtype=np.int64), inverse=True)


@dataclass(frozen=True, slots=True)
class _EpochLayout:
    """Where each window of one epoch starts (in positions) and which shards it holds, in order."""

    window_starts: np.ndarray
    """int64, len = windows + 1 (the last entry is N)."""
    window_shards: tuple[np.ndarray, ...]
    """Per window, the shard indices in the epoch's shard order."""


class SampleOrder:
    """Positions -> global sample ids, a bijection per epoch keyed by (seed, epoch[, window])."""

    def __init__(self, shard_samples: Sequence[int], *, seed: int, window_shards: int = 0) -> None:
        sizes = np.asarray(list(shard_samples), dtype=np.int64)
        if sizes.size == 0 or (sizes < 0).any() or sizes.sum() == 0:
            raise RecipeError(f"shard sample counts must be >= 0 with at least one sample, got {list(shard_samples)[:8]}")
        if window_shards < 0:
            raise RecipeError(f"window_shards = {window_shards}: must be >= 0 (0 = one global shuffle)")
        self.seed = int(seed)
        self.shard_samples = sizes
        self.shard_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_samples = int(self.shard_offsets[-1])
        self.window_shards = 0 if window_shards >= len(sizes) else int(window_shards)
        self._layouts: dict[int, _EpochLayout] = {}
        self._blocks: dict[tuple[int, int], np.ndarray] = {}
        """Kept blocks of ids by (epoch, block), least recently used first."""
        self._lock = threading.Lock()  # a loader's read-ahead thread and its caller both ask

    def _layout(self, epoch: int) -> _EpochLayout:
        layout = self._layouts.get(epoch)
        if layout is not None:
            return layout
        count = len(self.shard_samples)
        if self.window_shards == 0:
            layout = _EpochLayout(np.array([0, self.num_samples], dtype=np.int64), (np.arange(count),))
        else:
            shard_order = FeistelPermutation(count, round_keys(self.seed, epoch, "shards"))(np.arange(count))
            groups = tuple(shard_order[i : i + self.window_shards] for i in range(0, count, self.window_shards))
            sizes = [int(self.shard_samples[g].sum()) for g in groups]
            layout = _EpochLayout(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), groups)
        if len(self._layouts) > 4:  # only the current and next epoch are ever hot
            self._layouts.clear()
        self._layouts[epoch] = layout
        return layout

    def epoch_of(self, position: int) -> int:
        return int(position) // self.num_samples

    def ids(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Global sample ids (int64) of stream positions (any ints >= 0, any order, any epoch)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and pos.min() < 0:
            raise RecipeError("stream positions must be >= 0")
        out = np.empty_like(pos)
        if not pos.size:
            return out
        epochs, within = np.divmod(pos, self.num_samples)
        first, last = int(epochs.min()), int(epochs.max())
        for epoch in range(first, last + 1) if last - first < 8 else np.unique(epochs).tolist():
            mine = slice(None) if first == last else epochs == epoch
            q = within[mine]
            if not q.size:
                continue
            lo, hi = int(q.min()) // _BLOCK, int(q.max()) // _BLOCK
            if hi - lo > 1:  # scattered: computed directly
                out[mine] = self._ids_in_epoch(epoch, q)
                continue
            table = self._block(epoch, lo)
            if hi > lo:
                table = np.concatenate([table, self._block(epoch, hi)])
            out[mine] = table[q - lo * _BLOCK]
        return out

    def ids_range(self, start: int, count: int) -> np.ndarray:
        return self.ids(np.arange(start, start + count, dtype=np.int64))

    def _block(self, epoch: int, block: int) -> np.ndarray:
        """The ids of positions ``[block*B, (block+1)*B)`` of ``epoch`` (``B = _BLOCK``; the epoch's
        last block shorter), computed once and kept: ``_BLOCKS_KEPT``, the least recently used dropped."""
        key = (epoch, block)
        with self._lock:
            table = self._blocks.pop(key, None)
            if table is not None:
                self._blocks[key] = table  # now the most recently used
                return table
        q = np.arange(block * _BLOCK, min((block + 1) * _BLOCK, self.num_samples), dtype=np.int64)
        table = self._ids_in_epoch(epoch, q)
        table.setflags(write=False)
        with self._lock:
            self._blocks[key] = table
            while len(self._blocks) > _BLOCKS_KEPT:
                del self._blocks[next(iter(self._blocks))]
        return table

    def _ids_in_epoch(self, epoch: int, q: np.ndarray) -> np.ndarray:
        """The ids of positions ``q`` within ``epoch``, computed (the permutation, then the windows)."""
        layout = self._layout(epoch)
        if self.window_shards == 0:
            return FeistelPermutation(self.num_samples, round_keys(self.seed, epoch))(q)
        out = np.empty_like(q)
        windows = np.searchsorted(layout.window_starts, q, side="right") - 1
        for window in np.unique(windows):
            here = windows == window
            shards = layout.window_shards[window]
            size = int(layout.window_starts[window + 1] - layout.window_starts[window])
            perm = FeistelPermutation(size, round_keys(self.seed, epoch, "window", window))
            local = perm(q[here] - layout.window_starts[window])
            # The window's samples are its shards' samples, concatenated in the epoch's shard order.
            bounds = np.concatenate([[0], np.cumsum(self.shard_samples[shards])])
            which = np.searchsorted(bounds, local, side="right") - 1
            out[here] = self.shard_offsets[shards[which]] + (local - bounds[which])
        return out
