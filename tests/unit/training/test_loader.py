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
    ahead = steps + 2 + 1  # prefetch_steps = 2 batches queued, one more being built
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
