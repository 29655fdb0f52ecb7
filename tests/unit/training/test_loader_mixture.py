"""The streaming loader over a mixture of sources (real packed tokens, one per source): each global
batch is drawn by weight through ``kiln_trainer.mixture``, the same ids and rows at every world size,
each source's rows its own samples, a bitwise resume from the state mid-run, per-source counts; and
one source keeps the plain order, bitwise what the loader gave before mixtures existed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kiln_trainer.contract.training_manifest import mixture_tokens_sha256
from kiln_trainer.errors import BlockSizeMismatchError, RecipeError, ResumeMismatchError
from kiln_trainer.loader import LoaderSource, TokenLoader
from kiln_trainer.mixture import Mixture, MixtureSource
from kiln_trainer.packed import ConcatenatedTokens, PackedTokens, TokenManifest, pack_corpus
from kiln_trainer.sample_order import SampleOrder
from kiln_trainer.tokenizer import ByteTokenizer

from trainer_fixtures import stdlib_sources

B = 16
WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}


def _pack(root: Path, name: str, docs: list[str], shard_samples: int = 150) -> TokenManifest:
    return pack_corpus(root, snapshot_id=f"{name}.dir", tokenizer=ByteTokenizer(), block_size=B,
                       parts=[docs[: len(docs) // 2], docs[len(docs) // 2 :]], shard_bytes=shard_samples * (B + 1) * 2)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TokenManifest]:
    """Three real packed corpora of unequal sizes (~2400, ~1000 and ~100 samples; shards of 150 and
    partial ones), so the small one wraps into later epochs within a test."""
    root = tmp_path_factory.mktemp("mixture-tokens")
    texts = [text for _, text in stdlib_sources(60_000)]
    return {
        "web": _pack(root, "web", texts[: len(texts) * 2 // 3]),
        "code": _pack(root, "code", texts[len(texts) * 2 // 3 :]),
        "books": _pack(root, "books", _synthetic_docs(2, 3), shard_samples=40),
    }


class RecordingTokens(PackedTokens):
    """The real reader, also recording which of its sample ids were read (by its shard reads: the mixed
    loader reads every source's shards through one ``ConcatenatedTokens``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requested: list[int] = []

    def _rows(self, shard, rows):
        self.requested.extend((self.offsets[shard] + np.asarray(rows)).tolist())
        return super()._rows(shard, rows)


def _sources(packed, weights=WEIGHTS, recording=False) -> list[LoaderSource]:
    kind = RecordingTokens if recording else PackedTokens
    return [LoaderSource(name, weight, kind(packed[name])) for name, weight in weights.items()]


def _loader(packed, *, world_size=1, rank=0, micro=2, global_batch=24, seed=3, window=0, weights=WEIGHTS,
            recording=False, **kw) -> TokenLoader:
    return TokenLoader(_sources(packed, weights, recording), global_batch_size=global_batch, micro_batch_size=micro,
                       rank=rank, world_size=world_size, seed=seed, window_shards=window, **kw)


def _run(packed, steps, *, world_size=1, micro=2, global_batch=24, seed=3, window=0, state=None, recording=False):
    """Per step, the global batch's ids, rows and sources in rank order; and the loaders (closed)."""
    loaders = [_loader(packed, world_size=world_size, rank=r, micro=micro, global_batch=global_batch, seed=seed,
                       window=window, recording=recording) for r in range(world_size)]
    try:
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        out = []
        for _ in range(steps):
            parts = [loader.next_step() for loader in loaders]
            out.append((np.concatenate([p.sample_ids for p in parts]),
                        np.concatenate([mb for p in parts for mb in p.micro_batches]),
                        np.concatenate([p.sources for p in parts])))
        return out, loaders
    finally:
        for loader in loaders:
            loader.close()


def test_each_row_is_its_sources_sample_in_position_order(packed):
    """Rows come from the drawn source's own PackedTokens, scattered back to their positions; the ids
    are the mixture's global ids (the sources concatenated in declared order)."""
    [(ids, rows, sources)], [loader] = _run(packed, 1, global_batch=96, micro=8)
    mix = loader.mixture
    assert mix is not None
    drawn = mix.draw_range(0, 96)
    assert np.array_equal(ids, drawn.global_ids) and np.array_equal(sources, drawn.sources)
    assert len(set(sources.tolist())) == 3, "a batch of 96 holds every source"
    for i, (j, sample) in enumerate(zip(drawn.sources, drawn.samples, strict=True)):
        name = list(WEIGHTS)[int(j)]
        assert np.array_equal(rows[i], PackedTokens(packed[name]).read([int(sample)])[0])
    assert rows.dtype == np.int64 and rows.shape == (96, B + 1)


def test_concatenated_tokens_read_the_parts_as_one_id_space(packed, tmp_path):
    """The mixed loader's reader: part j's sample i is id offset_j + i, read as the part reads it."""
    parts = [PackedTokens(packed[name]) for name in WEIGHTS]
    both = ConcatenatedTokens(parts)
    sizes = [p.num_samples for p in parts]
    assert both.num_samples == sum(sizes) and both.part_offsets.tolist() == [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
    ids = np.random.default_rng(5).permutation(both.num_samples)[:300]
    ids = np.concatenate([ids, [0, sizes[0] - 1, sizes[0], both.num_samples - 1, 7, 7]])
    got = both.read(ids)
    part = np.searchsorted(both.part_offsets, ids, side="right") - 1
    want = np.stack([parts[j].read([i - both.part_offsets[j]])[0] for j, i in zip(part, ids, strict=True)])
    assert np.array_equal(got, want) and got.dtype == np.int64
    with pytest.raises(RecipeError, match=rf"sample ids must be in \[0, {both.num_samples}\)"):
        both.read([both.num_samples])
    other = pack_corpus(tmp_path, snapshot_id="wide.dir", tokenizer=ByteTokenizer(), block_size=B * 2,
                        parts=[_synthetic_docs(1, 2)])
    with pytest.raises(BlockSizeMismatchError, match=rf"\[{B + 1}, {2 * B + 1}\]"):
        ConcatenatedTokens([parts[0], PackedTokens(other)])


def test_a_capped_source_stops_the_loader_at_the_same_step_at_every_world_size(packed):
    """``cap_stop``: the first global batch that would draw a capped source past its cap (an epoch
    cap or a token budget, the earlier wins), from the draw alone: the same at world sizes 1, 2 and 4."""
    books = PackedTokens(packed["books"]).num_samples
    capped = {"books": {"max_epochs": 2}, "code": {"max_tokens": 10_000}}

    def loader(world_size=1, rank=0, caps=capped, global_batch=24):
        srcs = [LoaderSource(name, w, PackedTokens(packed[name]), **caps.get(name, {})) for name, w in WEIGHTS.items()]
        return TokenLoader(srcs, global_batch_size=global_batch, micro_batch_size=2, rank=rank, world_size=world_size, seed=3)

    stops = {(w, r): loader(w, r).cap_stop for w in (1, 2, 4) for r in range(w)}
    stop = stops[(1, 0)]
    assert stop is not None and set(stops.values()) == {stop}
    # Brute force over the loader's own global batches: the first that draws a source past its cap.
    one = loader()
    mix = one.mixture
    assert mix is not None
    limits = {"books": 2 * books, "code": 10_000 // B}
    first = {name: next(step for step in range(10_000) if mix.drawn((step + 1) * 24)[j] > limits[name])
             for j, name in enumerate(WEIGHTS) if name in limits}
    name = min(first, key=lambda n: (first[n], mix.first_past(list(WEIGHTS).index(n), limits[n])))
    assert (stop.step, stop.source, stop.draws) == (first[name], name, limits[name])
    assert stop.limit == ("max_epochs = 2" if name == "books" else "max_tokens = 10000")
    assert stop.to_json() == {"reason": "mixture_cap", "source": name, "limit": stop.limit, "draws": limits[name],
                              "loader_step": stop.step}
    assert loader(caps={}).cap_stop is None
    only_books = loader(caps={"books": {"max_epochs": 2}}).cap_stop
    assert only_books is not None and only_books.source == "books" and only_books.step == first["books"]
    # One source (the plain order): its k-th draw is position k.
    single = TokenLoader([LoaderSource("web", 1.0, PackedTokens(packed["web"]), max_tokens=100 * B)], global_batch_size=24,
                         micro_batch_size=2, rank=0, world_size=1, seed=3)
    assert single.mixture is None and single.cap_stop is not None and single.cap_stop.step == 100 // 24
    with pytest.raises(RecipeError, match=r"source 'code': its cap max_tokens = 16 \(1 samples\) is reached within the first"):
        loader(caps={"code": {"max_tokens": 16}})
    with pytest.raises(RecipeError, match=r"sources\[2\] \('books'\)\.max_epochs = 0: must be an int >= 1"):
        loader(caps={"books": {"max_epochs": 0}})


def test_shares_are_within_one_percent_of_the_weights_over_many_batches(packed):
    """Through the loader (reading every row): each source's share of 400 global batches of 24, and of
    every batch, follows its weight (the draw's bound: within ceil(log2 3) = 2 samples a batch)."""
    steps, g = 400, 24
    out, [loader] = _run(packed, steps, global_batch=g, micro=24)
    counts = np.stack([np.bincount(sources, minlength=3) for _, _, sources in out])
    wanted = np.array(list(WEIGHTS.values())) / sum(WEIGHTS.values())
    assert np.abs(counts.sum(axis=0) / (steps * g) - wanted).max() <= 0.01
    assert np.abs(counts - g * wanted[None, :]).max() <= 2
    report = loader.mixture_report()
    assert report is not None
    assert [r["drawn"] for r in report] == counts.sum(axis=0).tolist()
    assert [r["share"] for r in report] == pytest.approx((counts.sum(axis=0) / (steps * g)).tolist())


def test_shares_over_10_4_batches_of_64_by_the_loaders_ids(packed):
    """The issue's figure, by the ids the loader draws (its mixture over the 10**4 batches' positions in
    one call, as ``global_batch_ids`` draws one batch; no reads), spot-checked against ``global_batch_ids``."""
    loader = _loader(packed, global_batch=64, micro=64)
    offsets = np.cumsum([0] + [packed[n].samples for n in WEIGHTS])
    assert loader.mixture is not None
    ids = loader.mixture.draw_range(0, 64 * 10_000).global_ids
    for step in (0, 1, 4_321, 9_999):
        assert np.array_equal(loader.global_batch_ids(step * 64), ids[step * 64 : (step + 1) * 64])
    shares = np.bincount(np.searchsorted(offsets, ids, side="right") - 1, minlength=3) / ids.size
    wanted = np.array(list(WEIGHTS.values())) / sum(WEIGHTS.values())
    assert np.abs(shares - wanted).max() <= 0.01


@pytest.mark.parametrize("window", [0, 2])
def test_the_same_global_ids_and_rows_at_world_sizes_1_2_and_4(packed, window):
    """Each rank reads its contiguous quarter/half of each global batch: concatenated in rank order they
    are the 1-rank batches, ids and rows; and a rank asks each source only for its own positions' samples."""
    steps, g = 6, 24
    reference, _ = _run(packed, steps, world_size=1, micro=4, global_batch=g, window=window)
    for world in (2, 4):
        got, loaders = _run(packed, steps, world_size=world, micro=3 if world == 2 else 2, global_batch=g,
                            window=window, recording=True)
        for step, ((ref_ids, ref_rows, ref_src), (ids, rows, src)) in enumerate(zip(reference, got, strict=True)):
            assert np.array_equal(ids, ref_ids), f"step {step} at world size {world}"
            assert np.array_equal(rows, ref_rows) and np.array_equal(src, ref_src)
        mix = loaders[0].mixture
        assert mix is not None
        share = g // world
        ahead = steps + 2 + 1  # queued by the prefetcher, and one being built
        for rank, loader in enumerate(loaders):
            mine = mix.draw(np.concatenate([np.arange(s * g + rank * share, s * g + (rank + 1) * share)
                                            for s in range(ahead)]))
            for j, source in enumerate(loader.sources):
                asked = set(source.tokens.requested)  # type: ignore[attr-defined]
                assert asked and asked <= set(mine.samples[mine.sources == j].tolist()), (rank, source.name)


@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1), (2, 4), (1, 1)])
def test_a_resume_from_the_state_mid_run_continues_bitwise(packed, before, after):
    """The state after 7 steps (through JSON, as a checkpoint keeps it), resumed at another world size:
    the next steps' ids and rows are those of the uninterrupted run, bit for bit."""
    g, done, more = 24, 7, 5
    uninterrupted, _ = _run(packed, done + more, world_size=1, micro=2, global_batch=g)
    _, first = _run(packed, done, world_size=before, micro=2, global_batch=g)
    states = [loader.state_dict() for loader in first]
    assert all(s == states[0] for s in states), "every rank holds the same state"
    state = json.loads(json.dumps(states[0]))
    assert state["mixture"]["consumed_samples"] == state["consumed_samples"] == done * g
    resumed, _ = _run(packed, more, world_size=after, micro=2, global_batch=g, state=state)
    for step, ((ids, rows, src), (ref_ids, ref_rows, ref_src)) in enumerate(zip(resumed, uninterrupted[done:], strict=True)):
        assert np.array_equal(ids, ref_ids) and np.array_equal(rows, ref_rows) and np.array_equal(src, ref_src), step


def test_the_small_source_wraps_each_sample_once_per_epoch(packed):
    """books (~100 samples, weight 0.1) runs through several epochs in 300 batches of 24: each of its
    epochs is a permutation of its samples, a new one each time, and the report counts the epochs."""
    n = packed["books"].samples
    steps = 300
    out, [loader] = _run(packed, steps, global_batch=24, micro=24)
    offset = packed["web"].samples + packed["code"].samples
    books = np.concatenate([ids[src == 2] for ids, _, src in out]) - offset
    epochs = len(books) // n
    assert epochs >= 5
    for e in range(epochs):
        assert np.array_equal(np.sort(books[e * n : (e + 1) * n]), np.arange(n)), f"epoch {e}"
    assert not np.array_equal(books[:n], books[n : 2 * n])
    report = {r["name"]: r for r in loader.mixture_report() or []}
    assert report["books"]["epoch"] == len(books) // n and report["books"]["drawn"] == len(books)
    assert report["web"]["epoch"] == report["web"]["drawn"] // packed["web"].samples < report["books"]["epoch"]


def test_the_state_names_every_source_and_a_resume_refuses_another_mixture(packed):
    _, [loader] = _run(packed, 3)
    state = loader.state_dict()
    assert state["token_manifest_sha256"] == mixture_tokens_sha256(
        [(n, w, packed[n].sha256) for n, w in WEIGHTS.items()])
    assert state["sources"] == [{"name": n, "weight": w, "token_manifest_sha256": packed[n].sha256}
                                for n, w in WEIGHTS.items()]
    assert [s["drawn"] for s in state["mixture"]["sources"]] == list(loader.mixture.drawn(72))  # type: ignore[union-attr]
    with pytest.raises(ResumeMismatchError, match="sources"):
        _loader(packed, weights={**WEIGHTS, "books": 0.2}).load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match="sources"):
        _loader(packed, weights={"web": 0.6, "books": 0.1, "code": 0.3}).load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match="seed"):
        _loader(packed, seed=4).load_state_dict(state)
    edited = json.loads(json.dumps(state))
    edited["mixture"]["sources"][1]["drawn"] += 1
    with pytest.raises(ResumeMismatchError, match=r"sources\[1\]\.drawn"):
        _loader(packed).load_state_dict(edited)
    with pytest.raises(ResumeMismatchError, match="consumed_samples = 96, but its mixture state says 72"):
        _loader(packed).load_state_dict({**state, "consumed_samples": 96})
    with pytest.raises(ResumeMismatchError, match="mixture state is not"):
        _loader(packed).load_state_dict({k: v for k, v in state.items() if k != "mixture"})
    one = TokenLoader(PackedTokens(packed["web"]), global_batch_size=24, micro_batch_size=2, rank=0, world_size=1, seed=3)
    with pytest.raises(ResumeMismatchError, match="token_manifest_sha256"):
        one.load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match="token_manifest_sha256"):
        _loader(packed).load_state_dict(one.state_dict())


def test_the_report_counts_draws_epochs_shares_and_what_the_guard_skipped(packed):
    loader = _loader(packed, global_batch=24, micro=24)
    assert loader.mixture_report() == [
        {"name": n, "weight": w, "weight_share": pytest.approx(w), "drawn": 0, "epoch": 0, "share": 0.0,
         "trained_samples": 0, "tokens": 0, "token_manifest_sha256": packed[n].sha256} for n, w in WEIGHTS.items()]
    batches = [loader.next_step(), None, loader.next_step()]
    loader.skip_step()  # the guard's: batch 1 is drawn, never trained on
    batches[1] = None
    batches.append(loader.next_step())
    loader.close()
    assert loader.consumed_samples == 4 * 24
    report = loader.mixture_report(skipped_batches=[2, 9])  # batch 9 is not drawn yet: not counted
    trained = np.concatenate([b.sources for b in batches if b is not None and b.step != 2])
    assert [b.step for b in batches if b is not None] == [0, 1, 3]
    assert report is not None
    assert sum(r["drawn"] for r in report) == 96
    assert [r["trained_samples"] for r in report] == np.bincount(trained, minlength=3).tolist()
    assert [r["tokens"] for r in report] == [B * r["trained_samples"] for r in report]
    metrics = loader.mixture_metrics()
    assert set(metrics) == {f"mixture_{what}_{n}" for what in ("share", "drawn", "epoch") for n in WEIGHTS}
    assert metrics["mixture_drawn_code"] == report[1]["drawn"]
    one = TokenLoader(PackedTokens(packed["web"]), global_batch_size=24, micro_batch_size=2, rank=0, world_size=1, seed=3)
    assert one.mixture_report() is None and one.mixture_metrics() == {}


def test_sources_of_other_block_sizes_are_refused_naming_both(packed, tmp_path):
    other = pack_corpus(tmp_path, snapshot_id="b32.dir", tokenizer=ByteTokenizer(), block_size=32,
                        parts=[[text for _, text in stdlib_sources(3_000)]])
    with pytest.raises(BlockSizeMismatchError, match="'wide'.*33 tokens, 'web'.*17"):
        TokenLoader([LoaderSource("web", 1.0, PackedTokens(packed["web"])), LoaderSource("wide", 1.0, PackedTokens(other))],
                    global_batch_size=8, micro_batch_size=8, rank=0, world_size=1, seed=1)
    with pytest.raises(RecipeError, match=r"sources\[1\] \('code'\)\.weight"):
        _loader(packed, weights={"web": 1.0, "code": -1.0})
    with pytest.raises(RecipeError, match="no source"):
        TokenLoader([], global_batch_size=8, micro_batch_size=8, rank=0, world_size=1, seed=1)


def test_the_sample_log_of_a_mixture_records_its_global_ids(packed, tmp_path):
    logs = [tmp_path / f"rank{r}.jsonl" for r in range(2)]
    loaders = [_loader(packed, world_size=2, rank=r, sample_log=logs[r]) for r in range(2)]
    batches = [[loader.next_step() for _ in range(2)] for loader in loaders]
    for loader in loaders:
        loader.close()
    for rank, log in enumerate(logs):
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert [line["sample_ids"] for line in lines] == [b.sample_ids.tolist() for b in batches[rank]]


# ------------------------------------------------------------------ one source: the plain order, unchanged


def _synthetic_docs(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "kiln", "token", "mixture", "λ", "def", "return"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 200)))) for _ in range(n)]


ONE_SOURCE_SHA256 = "9a2da45a75773561254a082345a14437ab79e76f4f3945673860c607c56f174e"
"""sha256 of the ids, rows and epochs below, computed with the loader of d4d0a0b (before mixtures)."""


def _one_source_digest(make) -> str:
    digest = hashlib.sha256()
    for world in (1, 2):
        for rank in range(world):
            loader = make(rank, world)
            for _ in range(40):
                batch = loader.next_step()
                digest.update(batch.sample_ids.astype("<i8").tobytes())
                for mb in batch.micro_batches:
                    digest.update(mb.astype("<i8").tobytes())
                digest.update(str(batch.epoch).encode())
            loader.close()
    return digest.hexdigest()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> TokenManifest:
    """~760 samples of generated text (no dependence on this Python's stdlib files), shards of 100."""
    return _pack(tmp_path_factory.mktemp("one-source"), "one", _synthetic_docs(1, 20), shard_samples=100)


def test_one_source_gives_bitwise_the_batches_it_gave_before_mixtures(synthetic):
    """A plain PackedTokens and a single LoaderSource both take the plain SampleOrder path: the same
    ids, rows and epochs as the loader before this change (a pinned digest, 40 steps of 24 at world
    sizes 1 and 2, windows of 2 shards, through more than one epoch), and as SampleOrder + read."""
    def plain(rank, world):
        return TokenLoader(PackedTokens(synthetic), global_batch_size=24, micro_batch_size=4, rank=rank,
                           world_size=world, seed=7, window_shards=2)

    def single(rank, world):
        return TokenLoader([LoaderSource("one", 0.3, PackedTokens(synthetic))], global_batch_size=24, micro_batch_size=4,
                           rank=rank, world_size=world, seed=7, window_shards=2)

    assert synthetic.samples < 40 * 24, "the steps go past the first epoch"
    assert _one_source_digest(plain) == _one_source_digest(single) == ONE_SOURCE_SHA256
    loader = single(0, 1)
    order = SampleOrder([s.samples for s in synthetic.shards], seed=7, window_shards=2)
    batch = loader.next_step()
    loader.close()
    assert np.array_equal(batch.sample_ids, order.ids(np.arange(24)))
    assert batch.sources is None and loader.mixture is None
    state = loader.state_dict()
    assert set(state) == {"kind", "format", "consumed_samples", "seed", "global_batch_size", "num_samples",
                          "window_shards", "token_manifest_sha256"}
    assert state["token_manifest_sha256"] == synthetic.sha256 == loader.token_manifest_sha256


def test_a_mixture_of_one_name_would_be_another_order(synthetic):
    """Why one source keeps the plain path: the mixture keys a source's order by its name too."""
    mix = Mixture([MixtureSource("one", 1.0, [s.samples for s in synthetic.shards])], seed=7)
    plain = SampleOrder([s.samples for s in synthetic.shards], seed=7)
    assert not np.array_equal(mix.draw_range(0, 24).samples, plain.ids_range(0, 24))


def test_a_block_of_steps_read_at_once_draws_and_reads_what_steps_one_by_one_do(packed):
    """read_steps = 5 (the mixture draws 5 steps' positions in one call, their rows in one read): the
    same ids, rows, sources and epochs as a step-at-a-time read, while the small source wraps."""
    one, five = _loader(packed, read_steps=1), _loader(packed, read_steps=5)
    for step in range(40):
        a, b = one.next_step(), five.next_step()
        assert a.step == b.step == step and a.epoch == b.epoch
        assert np.array_equal(a.sample_ids, b.sample_ids) and np.array_equal(a.sources, b.sources)
        assert all(np.array_equal(x, y) for x, y in zip(a.micro_batches, b.micro_batches, strict=True))
    one.close()
    five.close()
