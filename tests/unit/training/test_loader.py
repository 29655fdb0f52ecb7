"""The streaming loader: the global batch of a step is the same set of samples at every world size,
each rank reads only its part, every sample comes once per epoch, and the state resumes anywhere."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln_trainer.errors import RecipeError, ResumeMismatchError, TokenShardError
from kiln_trainer.loader import TokenLoader
from kiln_trainer.packed import PackedTokens, TokenManifest, pack_corpus
from kiln_trainer.tokenizer import ByteTokenizer

from trainer_fixtures import stdlib_sources

B = 16
DOCS = [text for _, text in stdlib_sources(40_000)]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> TokenManifest:
    """~2400 samples in ~12 shards over 2 parts (shard sizes differ: the last of each part is partial)."""
    return pack_corpus(
        tmp_path_factory.mktemp("tokens"),
        snapshot_id="snap.dir",
        tokenizer=ByteTokenizer(),
        block_size=B,
        parts=[DOCS[: len(DOCS) // 3], DOCS[len(DOCS) // 3 :]],
        shard_bytes=220 * (B + 1) * 2,
    )


class RecordingTokens(PackedTokens):
    """The real reader, also recording which sample ids it was asked for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requested: list[int] = []

    def read(self, sample_ids):
        self.requested.extend(np.asarray(sample_ids).tolist())
        return super().read(sample_ids)


def _loader(manifest, *, world_size=1, rank=0, micro=2, global_batch=16, seed=1, window=0, tokens=None, **kw) -> TokenLoader:
    return TokenLoader(
        tokens or PackedTokens(manifest),
        global_batch_size=global_batch,
        micro_batch_size=micro,
        rank=rank,
        world_size=world_size,
        seed=seed,
        window_shards=window,
        **kw,
    )


def _global_batch(manifest, steps: int, world_size: int, micro: int, global_batch: int, seed: int, window: int):
    """Per step, the ids and rows all ranks read, in rank order; and each rank's requested ids."""
    loaders = [
        _loader(manifest, world_size=world_size, rank=r, micro=micro, global_batch=global_batch, seed=seed, window=window,
                tokens=RecordingTokens(manifest))
        for r in range(world_size)
    ]
    try:
        out = []
        for _ in range(steps):
            parts = [loader.next_step() for loader in loaders]
            ids = np.concatenate([p.sample_ids for p in parts])
            rows = np.concatenate([mb for p in parts for mb in p.micro_batches])
            out.append((ids, rows))
        return out, [sorted(set(loader.tokens.requested)) for loader in loaders], loaders[0]
    finally:
        for loader in loaders:
            loader.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world_size=st.integers(1, 8),
    micro=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**31),
    window=st.sampled_from([0, 1, 3]),
)
def test_global_batches_do_not_depend_on_the_world_size(manifest, world_size, micro, seed, window):
    global_batch = 24 * 7 * 8 // 8  # 168: divides by W x b for every W in 1..8 and b in 1..3 except where skipped below
    if global_batch % (world_size * micro):
        world_size = 1
    steps = 3
    reference, _, ref_loader = _global_batch(manifest, steps, 1, 1, global_batch, seed, window)
    got, requested, _ = _global_batch(manifest, steps, world_size, micro, global_batch, seed, window)
    for step, ((ref_ids, ref_rows), (ids, rows)) in enumerate(zip(reference, got, strict=True)):
        assert np.array_equal(ids, ref_ids), f"step {step} at world size {world_size}"
        assert np.array_equal(rows, ref_rows)
        assert np.array_equal(ids, ref_loader.global_batch_ids(step * global_batch))
    # Rank r asked the reader for its own slice of each global batch (consumed or prefetched), nothing else.
    share = global_batch // world_size
    # The read-ahead reads read_steps = 8 steps whenever fewer than prefetch_steps = 2 are ready: at most
    # 2 - 1 + 8 steps beyond those handed out.
    ahead = steps + 2 - 1 + 8
    for rank, asked in enumerate(requested):
        consumed = {int(i) for ids, _ in got for i in ids[rank * share : (rank + 1) * share]}
        slices = {
            int(i) for s in range(ahead) for i in ref_loader.global_batch_ids(s * global_batch)[rank * share : (rank + 1) * share]
        }
        others = {int(i) for s in range(steps) for i in ref_loader.global_batch_ids(s * global_batch)} - slices
        assert consumed <= set(asked) <= slices
        assert not set(asked) & others


def test_rows_are_the_samples_of_the_ids(manifest):
    loader = _loader(manifest, micro=4, global_batch=8)
    batch = loader.next_step()
    loader.close()
    assert np.array_equal(np.concatenate(batch.micro_batches), PackedTokens(manifest).read(batch.sample_ids))
    assert [mb.shape for mb in batch.micro_batches] == [(4, B + 1), (4, B + 1)]
    assert batch.micro_batches[0].dtype == np.int64


@pytest.mark.parametrize("window", [0, 2])
def test_every_sample_exactly_once_per_epoch(manifest, window):
    n = PackedTokens(manifest).num_samples
    g = 40  # does not divide n: batches straddle the epoch boundary
    loader = _loader(manifest, micro=8, global_batch=g, window=window, tokens=PackedTokens(manifest))
    ids = np.concatenate([loader.next_step().sample_ids for _ in range(2 * n // g + 1)])
    loader.close()
    epoch0, epoch1 = ids[:n], ids[n : 2 * n]
    assert np.array_equal(np.sort(epoch0), np.arange(n))
    assert np.array_equal(np.sort(epoch1), np.arange(n))
    assert not np.array_equal(epoch0, epoch1)  # a new permutation each epoch


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    before=st.sampled_from([1, 2, 4]),
    after=st.sampled_from([1, 2, 4]),
    steps_before=st.integers(0, 5),
    seed=st.integers(0, 2**31),
)
def test_state_restored_at_any_world_size_continues_the_same_sequence(manifest, before, after, steps_before, seed):
    g, micro = 16, 2
    uninterrupted, _, _ = _global_batch(manifest, steps_before + 3, 1, micro, g, seed, 0)
    first = [_loader(manifest, world_size=before, rank=r, micro=micro, global_batch=g, seed=seed) for r in range(before)]
    for _ in range(steps_before):
        for loader in first:
            loader.next_step()
    states = [loader.state_dict() for loader in first]
    for loader in first:
        loader.close()
    assert all(s == states[0] for s in states)  # every rank holds the same tiny state
    state = json.loads(json.dumps(states[0]))  # it survives a checkpoint's serialisation
    resumed = [_loader(manifest, world_size=after, rank=r, micro=micro, global_batch=g, seed=seed) for r in range(after)]
    for loader in resumed:
        loader.load_state_dict(state)
    for step in range(steps_before, steps_before + 3):
        ids = np.concatenate([loader.next_step().sample_ids for loader in resumed])
        assert np.array_equal(ids, uninterrupted[step][0])
    for loader in resumed:
        loader.close()


def test_state_counts_only_steps_handed_out_not_prefetched(manifest):
    loader = _loader(manifest, prefetch_steps=4)
    loader.next_step()
    loader.next_step()
    assert loader.state_dict()["consumed_samples"] == 32 and loader.step == 2
    loader.close()


def test_skip_step_drops_exactly_one_global_batch(manifest):
    reference = _loader(manifest)
    ids = [reference.next_step().sample_ids for _ in range(3)]
    reference.close()
    loader = _loader(manifest)
    loader.next_step()  # the prefetcher is running ahead: skipping must not lose or repeat a batch
    loader.skip_step()
    assert np.array_equal(loader.next_step().sample_ids, ids[2])
    loader.close()


@pytest.mark.parametrize(
    ("change", "field"),
    [({"seed": 2}, "seed"), ({"global_batch": 32}, "global_batch_size"), ({"window": 2}, "window_shards")],
)
def test_a_state_from_another_order_is_refused(manifest, change, field):
    state = _loader(manifest).state_dict()
    with pytest.raises(ResumeMismatchError, match=field):
        _loader(manifest, **change).load_state_dict(state)


def test_a_state_from_other_shards_is_refused(manifest):
    state = {**_loader(manifest).state_dict(), "token_manifest_sha256": "f" * 64}
    with pytest.raises(ResumeMismatchError, match="token_manifest_sha256"):
        _loader(manifest).load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match="consumed_samples"):
        _loader(manifest).load_state_dict({**_loader(manifest).state_dict(), "consumed_samples": -3})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch": 10, "world_size": 4, "micro": 1}, "must divide by world_size x micro_batch_size"),
        ({"global_batch": 16, "world_size": 2, "micro": 3}, "must divide by"),
        ({"world_size": 2, "rank": 2}, "rank = 2"),
        ({"micro": 0}, "micro_batch_size"),
        ({"prefetch_steps": 0}, "prefetch_steps"),
    ],
)
def test_bad_geometry_is_named(manifest, kwargs, message):
    with pytest.raises(RecipeError, match=message):
        _loader(manifest, **kwargs)


def test_accumulation_steps_make_up_the_global_batch(manifest):
    assert _loader(manifest, world_size=2, micro=2, global_batch=16).accum_steps == 4
    assert _loader(manifest, world_size=1, micro=2, global_batch=16).accum_steps == 8


def test_a_read_error_in_the_prefetch_thread_reaches_the_training_thread(manifest, tmp_path):
    tokens = PackedTokens(manifest)
    entry = manifest.shards[0]
    path = Path(manifest.path) / entry.path
    saved = path.read_bytes()
    try:
        os.truncate(path, entry.bytes - (B + 1) * 2)  # truncated after the start-up size check
        loader = _loader(manifest, tokens=tokens, global_batch=256, micro=256)
        with pytest.raises(TokenShardError, match=entry.path):
            for _ in range(20):
                loader.next_step()
        loader.close()
    finally:
        path.write_bytes(saved)


def test_sample_log_records_what_each_rank_read(manifest, tmp_path):
    logs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
    loaders = [_loader(manifest, world_size=2, rank=r, sample_log=logs[r]) for r in range(2)]
    batches = [[loader.next_step() for _ in range(3)] for loader in loaders]
    for loader in loaders:
        loader.close()
    for rank, log in enumerate(logs):
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert [line["step"] for line in lines] == [0, 1, 2]
        assert [line["sample_ids"] for line in lines] == [b.sample_ids.tolist() for b in batches[rank]]
        assert {line["rank"] for line in lines} == {rank} and lines[1]["consumed_before"] == 16


def _batches(loader: TokenLoader, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(b.sample_ids, np.concatenate(b.micro_batches)) for b in (loader.next_step() for _ in range(steps))]


def _wait_for(check, seconds: float = 10.0) -> None:
    """Until ``check()`` holds (the read-ahead thread's progress), or fail after ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "the read-ahead thread did not get there"
        time.sleep(0.005)


def test_a_block_of_steps_read_at_once_is_bitwise_the_steps_read_one_by_one(manifest):
    """read_steps = 5 (ids of 5 steps in one call of the order, their rows in one read) gives the batches
    a step-at-a-time read gives, across epoch ends, and each step's arrays are its own (not views of
    the block's, so a step handed out and dropped frees its memory)."""
    n = PackedTokens(manifest).num_samples
    steps = 2 * n // 40 + 3  # 40 does not divide n: blocks straddle the epoch ends
    one = _loader(manifest, micro=8, global_batch=40, read_steps=1)
    five = _loader(manifest, micro=8, global_batch=40, read_steps=5)
    got = [five.next_step() for _ in range(steps)]
    for step, ((ids, rows), batch) in enumerate(zip(_batches(one, steps), got, strict=True)):
        assert np.array_equal(ids, batch.sample_ids) and np.array_equal(rows, np.concatenate(batch.micro_batches)), step
        assert batch.step == step and batch.consumed_before == 40 * step and batch.epoch == 40 * step // n
        assert batch.micro_batches[0].base is None or batch.micro_batches[0].base.shape == (40, B + 1)
        assert batch.sample_ids.base is None
    one.close()
    five.close()


@pytest.mark.parametrize("window", [0, 2])
def test_a_resume_at_every_step_inside_a_read_block_is_bitwise_the_uninterrupted_run(manifest, window):
    """The state saved after s steps, while the read-ahead has read a block or more past s, resumes at
    exactly s: for every s through two blocks of read_steps = 4, the resumed loader's next steps are the
    uninterrupted run's, ids and rows bit for bit, and the state counts the steps handed out only."""
    k, g = 4, 16
    reference = _batches(_loader(manifest, window=window, read_steps=1), 3 * k + 2)
    for s in range(2 * k + 1):
        tokens = RecordingTokens(manifest)
        first = _loader(manifest, window=window, read_steps=k, tokens=tokens)
        done = _batches(first, s)
        if s:  # the read-ahead has read its next block: at least one step beyond the state, often k
            _wait_for(lambda s=s, tokens=tokens: len(tokens.requested) >= (s + 1) * g)
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        assert state["consumed_samples"] == s * g
        resumed = _loader(manifest, window=window, read_steps=k)
        resumed.load_state_dict(state)
        for step, ((ids, rows), (ref_ids, ref_rows)) in enumerate(zip(done + _batches(resumed, k + 1), reference,
                                                                      strict=False)):
            assert np.array_equal(ids, ref_ids) and np.array_equal(rows, ref_rows), (s, step)
        resumed.close()


def test_the_read_ahead_reads_a_block_per_wake_up_and_holds_a_bounded_number_of_steps(manifest):
    """With read_steps = 6 the reader is called once per 6 steps (one call of the order and one read a
    block), and never more than prefetch_steps - 1 + read_steps steps are held ready; with read_steps = 1,
    once a step."""

    class CountingTokens(PackedTokens):
        calls = 0

        def read(self, sample_ids):
            self.calls += 1
            return super().read(sample_ids)

    for k, prefetch in ((6, 2), (1, 2), (6, 3)):
        tokens = CountingTokens(manifest)
        loader = _loader(manifest, tokens=tokens, read_steps=k, prefetch_steps=prefetch)
        for step in range(1, 25):
            loader.next_step()
            # it reads while fewer than `prefetch` steps are ready, a block at a time: then it sleeps
            _wait_for(lambda tokens=tokens, step=step, k=k, prefetch=prefetch: tokens.calls * k >= step + prefetch)
            assert loader._ahead is not None and len(loader._ahead._items) <= prefetch - 1 + k
            assert tokens.calls * k <= step + prefetch - 1 + k
        loader.close()
        assert tokens.calls == -(-(24 + prefetch) // k)  # ceil: whole blocks, each read once


@pytest.mark.parametrize("read_steps", [4, 7])
def test_a_read_error_surfaces_at_the_step_it_belongs_to(manifest, read_steps):
    """A shard cut after it was opened: the steps before the first step that reads a lost row are
    handed out whole and right, and that step -- inside a block of read_steps, not at its start --
    raises the error a step-at-a-time read raises (the same type and message), in the training thread,
    with the state at that step."""
    entry = manifest.shards[0]  # global ids 0 .. entry.samples - 1
    path = Path(manifest.path) / entry.path
    reference = _loader(manifest, read_steps=1)
    n = reference.order.num_samples
    step_of = np.empty(n, dtype=np.int64)
    step_of[reference.order.ids_range(0, n)] = np.arange(n) // 16  # the first-epoch step that reads each id
    # Cut shard 0 at row c: the first step that reads a lost row is min(step_of[c:]); pick a c that puts
    # it past the first block and inside a block (not its first step).
    cut, fail_at = next((c, f) for c in range(entry.samples - 1, 0, -1)
                        if (f := int(step_of[c : entry.samples].min())) > read_steps and f % read_steps)
    expected = _batches(reference, fail_at)
    reference.close()
    saved = path.read_bytes()
    tokens = PackedTokens(manifest)
    tokens.read([0])  # opened and scanned whole: what is read later is read as asked
    errors = []
    try:
        os.truncate(path, cut * (B + 1) * 2)
        for k in (1, read_steps):
            loader = _loader(manifest, tokens=tokens, read_steps=k)
            got = _batches(loader, fail_at)
            assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(got, expected, strict=True))
            with pytest.raises(TokenShardError, match=f"{entry.path} ends at byte") as raised:
                loader.next_step()
            assert loader.step == fail_at
            errors.append(str(raised.value))
            loader.close()
    finally:
        path.write_bytes(saved)
    assert errors[0] == errors[1]
