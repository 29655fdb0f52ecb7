"""The sample order: a keyed bijection per epoch, with no O(samples) table, stable across versions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln_trainer.errors import RecipeError
from kiln_trainer.sample_order import FeistelPermutation, SampleOrder, round_keys


@pytest.mark.parametrize("n", [*range(1, 130), 255, 256, 257, 1023, 1024, 1025, 4096, 4097, 65_537])
def test_feistel_is_a_bijection_of_0_n_exhaustively(n):
    perm = FeistelPermutation(n, round_keys("test", n))
    out = perm(np.arange(n))
    assert np.array_equal(np.sort(out), np.arange(n))
    assert np.array_equal(perm.inverse(out), np.arange(n))


def test_feistel_at_three_billion_samples_by_sampling():
    n = 3_000_000_019  # > 2**31: needs 64-bit arithmetic all the way
    perm = FeistelPermutation(n, round_keys(1234, 0))
    x = np.unique(np.random.default_rng(0).integers(0, n, 200_000))
    x = np.concatenate([x, [0, 1, n - 2, n - 1]])
    y = perm(x)
    assert y.min() >= 0 and y.max() < n
    # 200k images of a non-injective map into 3e9 would collide ~7 times (birthday); a bijection never.
    assert len(np.unique(y)) == len(x)
    assert np.array_equal(perm.inverse(y), x)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**63), epoch=st.integers(0, 10_000))
def test_feistel_bijection_property(n, seed, epoch):
    perm = FeistelPermutation(n, round_keys(seed, epoch))
    assert np.array_equal(np.sort(perm(np.arange(n))), np.arange(n))


def test_keys_change_the_permutation_and_the_same_key_repeats_it():
    a = FeistelPermutation(1000, round_keys(1, 0))(np.arange(1000))
    b = FeistelPermutation(1000, round_keys(1, 1))(np.arange(1000))
    again = FeistelPermutation(1000, round_keys(1, 0))(np.arange(1000))
    assert np.array_equal(a, again)
    assert not np.array_equal(a, b)
    assert (a == np.arange(1000)).sum() < 20  # shuffled, not the identity (a random one has ~1 fixed point)


def test_the_order_is_pinned_across_versions():
    """A resumed run on a newer kiln must train on the same sequence: these ids may never change."""
    order = SampleOrder([5, 0, 7, 3, 11], seed=3, window_shards=2)
    assert order.ids_range(0, 10).tolist() == [4, 25, 24, 21, 0, 1, 19, 2, 22, 23]
    assert SampleOrder([1000], seed=7).ids_range(0, 6).tolist() == SampleOrder([400, 600], seed=7).ids_range(0, 6).tolist()


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda s: sum(s) > 0),
    window=st.integers(0, 13),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 50),
)
def test_every_sample_exactly_once_per_epoch(sizes, window, seed, epoch):
    order = SampleOrder(sizes, seed=seed, window_shards=window)
    n = order.num_samples
    ids = order.ids_range(epoch * n, n)
    assert np.array_equal(np.sort(ids), np.arange(n))


def test_windows_keep_reads_inside_a_few_shards():
    sizes = [10] * 20
    order = SampleOrder(sizes, seed=5, window_shards=4)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for start in range(0, 200, 40):  # each window is 4 shards x 10 samples = 40 positions
        shards = set((np.searchsorted(offsets, order.ids_range(start, 40), side="right") - 1).tolist())
        assert len(shards) == 4


def test_positions_are_independent_of_how_they_are_asked_for():
    order = SampleOrder([17, 3, 40], seed=9, window_shards=1)
    whole = order.ids_range(0, 300)
    pieces = np.concatenate([order.ids(np.arange(i, min(i + 7, 300))) for i in range(0, 300, 7)])
    assert np.array_equal(whole, pieces)
    shuffled = np.random.default_rng(1).permutation(300)
    assert np.array_equal(order.ids(shuffled), whole[shuffled])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shard_samples": [], "seed": 0}, "at least one sample"),
        ({"shard_samples": [0, 0], "seed": 0}, "at least one sample"),
        ({"shard_samples": [3, -1], "seed": 0}, ">= 0"),
        ({"shard_samples": [3], "seed": 0, "window_shards": -1}, "window_shards"),
    ],
)
def test_bad_order_arguments_are_named(kwargs, message):
    with pytest.raises(RecipeError, match=message):
        SampleOrder(**kwargs)


def test_negative_positions_and_empty_permutations_are_refused():
    with pytest.raises(RecipeError, match=">= 0"):
        SampleOrder([3], seed=0).ids([-1])
    with pytest.raises(RecipeError, match="n >= 1"):
        FeistelPermutation(0, round_keys(0))


@pytest.mark.parametrize("window", [0, 2])
def test_kept_blocks_give_the_ids_computed_directly(window):
    """A loader's queries (a few dozen consecutive positions at a time) are answered from blocks of
    ``_BLOCK`` ids of an epoch, kept: across block ends, epoch ends, blocks dropped and made again, they
    are the ids a whole-epoch query computes directly (it spans more than two blocks)."""
    from kiln_trainer import sample_order as module

    sizes = [5000, 3000, 1234, 700]  # 9934 samples: 3 blocks an epoch, the last one short
    order = SampleOrder(sizes, seed=11, window_shards=window)
    n, block = order.num_samples, module._BLOCK
    direct = np.concatenate([SampleOrder(sizes, seed=11, window_shards=window).ids_range(e * n, n) for e in range(2)])
    pieces = np.concatenate([order.ids(np.arange(p, min(p + 48, 2 * n))) for p in range(0, 2 * n, 48)])
    assert np.array_equal(pieces, direct)
    assert len(order._blocks) <= module._BLOCKS_KEPT and (1, 2) in order._blocks
    back = np.arange(block - 5, block + 5)  # far back: made again after being dropped, over a block end
    assert np.array_equal(order.ids(back), direct[back])
    scattered = np.random.default_rng(3).integers(0, 2 * n, 500)
    assert np.array_equal(order.ids(scattered), direct[scattered])


@pytest.mark.parametrize("n", [3, 400, 1000, 3000, 4097, 16_000])
def test_the_small_domain_table_walk_is_the_rounds_walk(n):
    """Asked for many ids of a small domain (at least a quarter of it), the permutation computes its
    rounds over the whole domain once and walks by lookups; a few ids at a time walk through the rounds.
    Both are the same map, forward and inverse."""
    perm = FeistelPermutation(n, round_keys("table", n))
    whole, back = perm(np.arange(n)), perm.inverse(np.arange(n))
    few = np.concatenate([perm(np.arange(i, min(i + 2, n))) for i in range(0, n, 2)])
    few_back = np.concatenate([perm.inverse(np.arange(i, min(i + 2, n))) for i in range(0, n, 2)])
    assert np.array_equal(whole, few) and np.array_equal(back, few_back)
    assert np.array_equal(perm.inverse(whole), np.arange(n))
