"""The draw of a data mixture: shares that follow the weights within a proven bound, each source's own
order untouched by the others, the same ids at every world size, a bitwise resume from a small state."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln_trainer import mixture as mixture_module
from kiln_trainer.errors import RecipeError, ResumeMismatchError, TrainerError
from kiln_trainer.loader import rank_positions
from kiln_trainer.mixture import MIXTURE_STATE_KIND, QUOTA_DENOMINATOR, Mixture, MixtureSource
from kiln_trainer.sample_order import SampleOrder

D = QUOTA_DENOMINATOR


def three(seed: int = 11, window_shards: int = 0) -> Mixture:
    return Mixture(
        [MixtureSource("web", 0.7, [40, 0, 23]), MixtureSource("code", 0.2, [17]), MixtureSource("books", 0.1, [5, 4])],
        seed=seed, window_shards=window_shards,
    )


def counts_by_prefix(sources: np.ndarray, k: int) -> np.ndarray:
    """``[len + 1, k]``: row ``n`` holds each source's count among the first ``n`` positions."""
    onehot = (sources[:, None] == np.arange(k)[None, :]).astype(np.int64)
    return np.concatenate([np.zeros((1, k), dtype=np.int64), np.cumsum(onehot, axis=0)])


# ---------------------------------------------------------------------------------------- shares


@pytest.mark.parametrize(
    "weights",
    [[0.5, 0.5], [0.9, 0.1], [0.1, 0.9], [0.7, 0.2, 0.1], [1, 1, 1], [0.98, 0.01, 0.01], [5, 3, 1, 1, 0.5]],
)
def test_shares_follow_the_weights_within_one_percent_over_10_4_batches_and_within_the_bound_everywhere(weights):
    g, batches = 64, 10_000
    mix = Mixture([MixtureSource(f"s{i}", w, [1000]) for i, w in enumerate(weights)], seed=5)
    k = len(weights)
    sources, _ = mix.split(np.arange(g * batches))
    shares = np.bincount(sources, minlength=k) / (g * batches)
    wanted = np.asarray(weights, dtype=float) / sum(weights)
    assert np.abs(shares - wanted).max() <= 0.01  # the goal ...
    assert np.abs(shares - wanted).max() <= math.ceil(math.log2(k)) / 2 / (g * batches) + 1 / D  # ... and the docstring's bound

    # Every prefix: |drawn_j(n) - n q_j / D| <= depth / 2, in exact integers.
    depth = math.ceil(math.log2(k)) if k > 1 else 0
    prefix = counts_by_prefix(sources, k)
    n = np.arange(len(prefix), dtype=np.int64)[:, None]
    quotas = np.asarray(mix.quotas, dtype=np.int64)[None, :]
    assert np.abs(2 * prefix * D - 2 * n * quotas).max() <= depth * D
    # So every global batch holds each source within `depth` samples of its share (1 for 2..4 sources).
    per_batch = np.diff(prefix[::g], axis=0)
    assert np.abs(per_batch - g * quotas / D).max() <= max(depth, 0.5)
    # drawn() is the same count, computed without drawing.
    for at in (0, 1, 63, 64, 12_345, g * batches):
        assert mix.drawn(at) == tuple(prefix[at].tolist())


def test_the_quotas_are_the_exact_shares_rounded_and_sum_to_the_denominator():
    for weights in ([0.7, 0.2, 0.1], [70, 20, 10], [1, 1, 1], [1e-6, 1.0], [3, 1e6], [1e300, 2e300]):
        quotas = Mixture([MixtureSource(f"s{i}", w, [3]) for i, w in enumerate(weights)], seed=0).quotas
        assert sum(quotas) == D and min(quotas) >= 1
        for w, q in zip(weights, quotas, strict=True):
            assert abs(q / D - w / sum(weights)) < 1 / D
    assert Mixture([MixtureSource("a", 0.7, [3]), MixtureSource("b", 0.3, [3])], seed=0).quotas == \
        Mixture([MixtureSource("a", 7, [3]), MixtureSource("b", 3, [3])], seed=0).quotas


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=7),
    start=st.integers(0, 2**62),
    seed=st.integers(0, 2**40),
)
def test_a_positions_draw_index_is_its_sources_count_before_it_at_any_position(weights, start, seed):
    """The k-th position a source gets is its draw k, at positions up to 2**62 (no int64 overflow)."""
    mix = Mixture([MixtureSource(f"s{i}", w, [7]) for i, w in enumerate(weights)], seed=seed)
    positions = np.arange(start, start + 200, dtype=np.int64)
    sources, draws = mix.split(positions)
    before = np.asarray(mix.drawn(start), dtype=np.int64)
    running = before[None, :] + counts_by_prefix(sources, len(weights))[:-1]
    assert np.array_equal(draws, running[np.arange(200), sources])
    assert mix.drawn(start + 200) == tuple((before + np.bincount(sources, minlength=len(weights))).tolist())
    depth = math.ceil(math.log2(len(weights))) if len(weights) > 1 else 0
    for j, (drawn, q) in enumerate(zip(mix.drawn(start), mix.quotas, strict=True)):
        assert abs(2 * drawn * D - 2 * start * q) <= depth * D, j


# ---------------------------------------------------------------------------------------- each source's order


def test_each_source_sees_every_sample_once_per_epoch_then_wraps_into_a_new_permutation():
    mix = three()
    d = mix.draw_range(0, 3000)  # web 63 samples, code 17, books 9: ~33, ~35, ~33 epochs
    for j, n in enumerate(mix.num_samples):
        mine = d.sources == j
        samples, draws, epochs = d.samples[mine], d.draws[mine], d.epochs[mine]
        assert np.array_equal(draws, np.arange(mine.sum()))  # a source's draws are 0, 1, 2, ... in position order
        assert np.array_equal(epochs, draws // n)
        whole = samples[: (len(samples) // n) * n].reshape(-1, n)
        assert len(whole) >= 30
        assert all(np.array_equal(np.sort(row), np.arange(n)) for row in whole)
        assert len({tuple(row) for row in whole}) > len(whole) // 2  # epochs are reshuffled, not repeated
        assert mix.epochs(3000)[j] == mix.drawn(3000)[j] // n
    offsets = np.asarray(mix.offsets)
    assert np.array_equal(d.global_ids, offsets[d.sources] + d.samples) and mix.offsets == (0, 63, 80)


@pytest.mark.parametrize("window_shards", [0, 1, 2])
def test_a_sources_draws_follow_its_own_sample_order(window_shards):
    """The vectorised draw equals each source's SampleOrder at its draw index (across epoch ends, with a
    source of one sample), so all of SampleOrder's guarantees hold per source."""
    mix = Mixture(
        [MixtureSource("big", 3.0, [1000, 2500, 37]), MixtureSource("one", 1.0, [0, 1]), MixtureSource("mid", 2.0, [300, 300])],
        seed=2**40 + 3, window_shards=window_shards,
    )
    positions = np.concatenate([np.arange(0, 20_000), np.random.default_rng(4).integers(0, 10**12, 150)])
    d = mix.draw(positions)
    for j, order in enumerate(mix.orders):
        mine = d.sources == j
        assert mine.any()
        assert np.array_equal(d.samples[mine], order.ids(d.draws[mine]))
        shards = len(mix.sources[j].shard_samples)
        assert isinstance(order, SampleOrder) and order.window_shards == (window_shards if window_shards < shards else 0)
    assert np.array_equal(mix.draw(positions.reshape(5, -1)).global_ids.reshape(-1), d.global_ids)


def test_step_sized_draws_through_kept_blocks_equal_each_sources_sample_order():
    """A loader's draws (a step's consecutive positions, step after step) go through blocks of ids kept
    per source (``_block``); scattered ones are permuted directly. Both are each source's SampleOrder:
    across block ends, epoch ends, blocks dropped and made again, and a draw that spans many blocks."""
    block = mixture_module._BLOCK
    mix = Mixture([MixtureSource("big", 5.0, [2 * block + 123, block // 2]), MixtureSource("mid", 3.0, [block - 5]),
                   MixtureSource("small", 1.0, [7, 0, 3]), MixtureSource("one", 0.5, [1])], seed=77)
    assert mix.num_samples[0] > 2 * block
    g = 96
    # From 'big''s draw N - 2500: its steps below cross a block end (2 * block) and its epoch's end.
    start = (mix.num_samples[0] - 2500) * D // mix.quotas[0]
    assert mix.num_samples[0] - 2500 < 2 * block
    for step in range(60):
        positions = np.arange(start + step * g, start + (step + 1) * g)
        d = mix.draw(positions)
        for j, order in enumerate(mix.orders):
            mine = d.sources == j
            assert np.array_equal(d.samples[mine], order.ids(d.draws[mine])), (step, j)
        assert all(len(kept) <= mixture_module._BLOCKS_KEPT for kept in mix._blocks)
    # 'big' was read through its kept blocks, not pushed out by 'one''s epoch (a block) a step.
    assert (0, 2) in mix._blocks[0] and (1, 0) in mix._blocks[0]
    # Far back (blocks made again after being dropped), and scattered over many blocks (direct).
    for positions in (np.arange(0, 5 * g), np.random.default_rng(1).integers(0, 10**9, 500),
                      np.arange(0, 60_000, 37)):
        d = mix.draw(positions)
        for j, order in enumerate(mix.orders):
            mine = d.sources == j
            assert np.array_equal(d.samples[mine], order.ids(d.draws[mine]))
    # A kept block is the permutation's, read-only: nothing a caller does to a draw changes the next one.
    d = mix.draw(np.arange(g))
    d.samples[:] = -1
    assert (mix.draw(np.arange(g)).samples >= 0).all()


def test_a_caps_first_past_position_and_stop_step_follow_the_draw():
    """``first_past(j, c)`` is the position of source j's draw number c (0-based), found without
    drawing; ``cap_step`` is the first global batch holding such a position, the earliest source's."""
    mix = three()
    sources, draws = mix.split(np.arange(12_000))  # books: 1200 draws
    for j in range(3):
        for cap in (0, 1, 5, 62, 63, 200, 1000):
            where = np.flatnonzero((sources == j) & (draws == cap))
            assert mix.first_past(j, cap) == int(where[0]), (j, cap)
    caps = [None, 2 * 17, 9]  # code: two epochs; books: one epoch
    step, source = mix.cap_step(caps, 24)
    positions = {j: mix.first_past(j, c) for j, c in enumerate(caps) if c is not None}
    assert source == min(positions, key=lambda j: positions[j]) and step == positions[source] // 24
    assert (mix.drawn(step * 24)[source] <= caps[source]) and mix.drawn((step + 1) * 24)[source] > caps[source]
    assert mix.cap_step([None, None, None], 24) is None
    with pytest.raises(RecipeError, match=r"caps: one per source \(3\), got 2"):
        mix.cap_step([None, 3], 24)
    with pytest.raises(RecipeError, match="cap = -1"):
        mix.first_past(0, -1)


def test_locate_is_split_of_one_position():
    mix = three()
    positions = np.concatenate([np.arange(300), np.random.default_rng(2).integers(0, 2**40, 200)])
    sources, draws = mix.split(positions)
    assert [mix.locate(int(p)) for p in positions] == list(zip(sources.tolist(), draws.tolist(), strict=True))
    single = Mixture([MixtureSource("only", 1.0, [5])], seed=0)
    assert single.locate(12) == (0, 12)
    with pytest.raises(RecipeError, match="stream position -1"):
        mix.locate(-1)


def test_adding_reweighting_or_reordering_sources_keeps_each_sources_own_order():
    a, b, c = MixtureSource("web", 0.5, [100, 23]), MixtureSource("code", 0.5, [40]), MixtureSource("books", 0.2, [9])

    def sequence(mix: Mixture, name: str, count: int) -> list[int]:
        j = [s.name for s in mix.sources].index(name)
        d = mix.draw_range(0, 4000)
        return d.samples[d.sources == j][:count].tolist()

    two = Mixture([a, b], seed=8)
    for other in (Mixture([a, b, c], seed=8), Mixture([c, b, MixtureSource("web", 3.0, [100, 23])], seed=8)):
        assert sequence(two, "web", 500) == sequence(other, "web", 500)
        assert sequence(two, "code", 300) == sequence(other, "code", 300)
        assert not np.array_equal(two.split(np.arange(100))[0], other.split(np.arange(100))[0])  # the positions do move
    renamed = Mixture([MixtureSource("web2", 0.5, [100, 23]), b], seed=8)
    assert sequence(two, "web", 100) != sequence(renamed, "web2", 100)
    assert sequence(two, "web", 100) != sequence(Mixture([a, b], seed=9), "web", 100)


# ---------------------------------------------------------------------------------------- world sizes, resume


def test_the_same_global_ids_at_world_sizes_1_2_and_4():
    """The loader's split of each global batch over ranks (``rank_positions``), concatenated in rank
    order, is the one-rank batch: the same sources, samples and global ids, from any starting point."""
    mix = three()
    g = 16
    for c0 in (0, 48, 10**9):
        whole = [mix.draw_range(c0 + s * g, g) for s in range(60)]
        for world in (1, 2, 4):
            for s, expected in enumerate(whole):
                parts = [mix.draw(rank_positions(c0 + s * g, global_batch_size=g, rank=r, world_size=world))
                         for r in range(world)]
                for field in ("sources", "samples", "global_ids", "epochs"):
                    assert np.array_equal(np.concatenate([getattr(p, field) for p in parts]), getattr(expected, field))
                assert all(len(p.samples) == g // world for p in parts)


def test_resume_from_a_mid_run_state_is_bitwise_at_any_world_size():
    g, steps, stop = 32, 200, 77
    uninterrupted = np.stack([three().draw_range(s * g, g).global_ids for s in range(steps)])

    state = three().state_dict(stop * g)
    state = json.loads(json.dumps(state))  # what a checkpoint holds: JSON, nothing else
    assert len(json.dumps(state)) < 1500 and state["kind"] == MIXTURE_STATE_KIND

    # The state's counts are the uninterrupted run's, and its epochs follow from them.
    sources_so_far = three().split(np.arange(stop * g))[0]
    assert [s["drawn"] for s in state["sources"]] == np.bincount(sources_so_far, minlength=3).tolist()
    assert [s["epoch"] for s in state["sources"]] == [s["drawn"] // s["num_samples"] for s in state["sources"]]

    for world in (1, 2, 4):
        fresh = three()  # a new process would build it from the same declaration
        consumed = fresh.resume(state)
        assert consumed == stop * g
        rest = []
        for _ in range(stop, steps):
            ranks = [fresh.draw(rank_positions(consumed, global_batch_size=g, rank=r, world_size=world)).global_ids
                     for r in range(world)]
            rest.append(np.concatenate(ranks))
            consumed += g
        assert np.array_equal(np.stack(rest), uninterrupted[stop:])


def test_realized_shares_are_the_counts_over_what_was_consumed():
    mix = three()
    assert mix.realized_shares(0) == tuple(q / D for q in mix.quotas)
    shares = mix.realized_shares(10_000)
    assert shares == tuple(d / 10_000 for d in mix.drawn(10_000))
    assert max(abs(s - w) for s, w in zip(shares, (0.7, 0.2, 0.1), strict=True)) < 1e-3


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda s: s.update(seed=12), "seed: checkpoint 12, now 11"),
        (lambda s: s.update(window_shards=2), "window_shards"),
        (lambda s: s["sources"][1].update(weight=0.3), "sources[1].weight: checkpoint 0.3, now 0.2"),
        (lambda s: s["sources"][0].update(name="prose"), "sources[0].name"),
        (lambda s: s["sources"][2].update(num_samples=10), "sources[2].num_samples"),
        (lambda s: s["sources"][2].update(shard_samples_blake2b="0" * 32), "sources[2].shard_samples_blake2b"),
        (lambda s: s["sources"].pop(), "sources: checkpoint ['web', 'code'], now ['web', 'code', 'books']"),
        (lambda s: s.update(algorithm="other/1"), "algorithm"),
        (lambda s: s["sources"][1].update(drawn=1), "sources[1].drawn: checkpoint 1, this draw gives"),
        (lambda s: s["sources"][2].update(epoch=0), "sources[2].epoch"),
        (lambda s: s.update(consumed_samples=-3), "consumed_samples = -3"),
        (lambda s: s.update(consumed_samples=True), "consumed_samples = True"),
        (lambda s: s.update(kind="kiln.LoaderState"), "kiln.MixtureState"),
    ],
)
def test_a_state_of_another_mixture_is_refused_naming_the_field(change, named):
    state = json.loads(json.dumps(three().state_dict(4096)))
    three().resume(state)  # unchanged, it resumes
    change(state)
    with pytest.raises(ResumeMismatchError) as err:
        three().resume(state)
    assert named in str(err.value)


def test_the_same_seed_gives_the_same_ids_in_another_process():
    code = (
        "import json; from kiln_trainer.mixture import Mixture, MixtureSource\n"
        "def m(w): return Mixture([MixtureSource('web', 0.7, [40, 0, 23]), MixtureSource('code', 0.2, [17]),"
        " MixtureSource('books', 0.1, [5, 4])], seed=11, window_shards=w)\n"
        "print(json.dumps([m(w).draw_range(10**6, 2000).global_ids.tolist() for w in (0, 1)]))\n"
    )
    here = [three(window_shards=w).draw_range(10**6, 2000).global_ids.tolist() for w in (0, 1)]
    for hash_seed in ("0", "12345"):  # str hashes differ between these processes; the draw must not
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert json.loads(out.stdout) == here
    assert three(seed=12).draw_range(10**6, 2000).global_ids.tolist() != three().draw_range(10**6, 2000).global_ids.tolist()


def test_the_draw_is_pinned_across_versions():
    """A resumed run on a newer kiln must train on the same sequence: these ids may never change."""
    d = three().draw_range(0, 12)
    assert d.sources.tolist() == [0, 1, 0, 0, 2, 0, 0, 0, 1, 0, 0, 1]
    assert d.global_ids.tolist() == PINNED_GLOBAL_IDS
    assert three(window_shards=1).draw_range(10**9, 6).global_ids.tolist() == PINNED_WINDOWED_IDS


PINNED_GLOBAL_IDS = [20, 74, 58, 23, 87, 48, 5, 47, 72, 46, 17, 64]
PINNED_WINDOWED_IDS = [25, 65, 34, 2, 1, 83]


# ---------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("weight", [0, 0.0, -1, float("nan"), float("inf"), -float("inf"), True, "0.5", None])
def test_a_weight_that_is_not_a_finite_positive_number_is_refused_naming_the_source(weight):
    with pytest.raises(RecipeError, match=r"sources\[1\] \('code'\)\.weight = .*must be a finite number > 0"):
        Mixture([MixtureSource("web", 1.0, [3]), MixtureSource("code", weight, [3])], seed=0)


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([], r"sources: a mixture needs at least one source, got none"),
        ((), r"sources: a mixture needs at least one source"),
        ("web", r"sources = 'web': must be a list of MixtureSource"),
        ([("web", 1.0, [3])], r"sources\[0\] = .*must be a MixtureSource"),
        ([MixtureSource("web", 1, [3]), MixtureSource("code", 1, [3]), MixtureSource("web", 2, [5])],
         r"sources\[2\]\.name = 'web': duplicate, sources\[0\] has the same name"),
        ([MixtureSource("", 1, [3])], r"sources\[0\]\.name = '': must be a non-empty string"),
        ([MixtureSource(7, 1, [3])], r"sources\[0\]\.name = 7"),  # type: ignore[arg-type]
        ([MixtureSource("web", 1, [3]), MixtureSource("code", 1, [0, 0])],
         r"sources\[1\] \('code'\)\.shard_samples: the source has no samples \(2 shard\(s\), all empty\)"),
        ([MixtureSource("web", 1, [])], r"sources\[0\] \('web'\)\.shard_samples = \[\]: must be one sample count"),
        ([MixtureSource("web", 1, [3, -1])], r"sources\[0\] \('web'\)\.shard_samples = \[3, -1\]"),
        ([MixtureSource("web", 1, [3.0])], r"sources\[0\] \('web'\)\.shard_samples"),
        ([MixtureSource("web", 1.0, [3]), MixtureSource("tiny", 1e-9, [3])],
         r"sources\[1\] \('tiny'\)\.weight = 1e-09: its share of the total \(1e-09\) is below the mixture's resolution"),
    ],
)
def test_a_bad_mixture_is_refused_naming_the_field(sources, message):
    with pytest.raises(RecipeError, match=message) as err:
        Mixture(sources, seed=0)
    assert isinstance(err.value, TrainerError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"seed": True}, "seed = True: must be an int"), ({"seed": 1.5}, "seed = 1.5"),
     ({"seed": 0, "window_shards": -1}, "window_shards = -1: must be an int >= 0")],
)
def test_bad_seed_or_window_is_refused(kwargs, message):
    with pytest.raises(RecipeError, match=message):
        Mixture([MixtureSource("web", 1.0, [3])], **kwargs)


def test_negative_positions_and_counts_are_refused():
    with pytest.raises(RecipeError, match="positions must be >= 0"):
        three().draw([3, -1])
    with pytest.raises(RecipeError, match="consumed = -1"):
        three().drawn(-1)
