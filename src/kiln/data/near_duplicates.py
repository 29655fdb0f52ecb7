"""Near-duplicate documents across (and within) shards: MinHash signatures and an LSH index (datasketch).

A contract turns it on with ``meta.kiln.near_duplicates``::

    {"kind": "datasketch.MinHashLSH", "column": "text", "num_perm": 128, "threshold": 0.8,
     "shingle_words": 5, "seed": 1}

* **Signature** (per shard, in the mapped validation tasks): the text normalised as datatrove's
  MinHash stage does (``datatrove.utils.text.simplify_text``: lower case, digits -> 0, punctuation
  and diacritics removed, whitespace collapsed), cut into overlapping ``shingle_words``-word
  shingles, hashed into ``num_perm`` minimum hashes by ``datasketch.MinHash`` (SHA-1 based,
  permutations drawn from ``seed``). A pure function of the text and the settings.
* **Index** (once, in the data gate): ``datasketch.MinHashLSH`` with bands chosen by datasketch for
  ``threshold``; each candidate pair it returns is kept only when the MinHash estimate of the Jaccard
  similarity reaches ``threshold``. Documents are visited in (shard path, row) order and each is
  compared with the documents kept before it, so the first copy stays and every later copy is
  dropped, whatever order the validation tasks finished in: deterministic for a snapshot.

Why datasketch and not datatrove's MinHash stages: those are a four-step file pipeline (signatures ->
buckets -> clusters -> filter) over datatrove's own reader and folder layout, built for corpora one
machine cannot index in memory; kiln's gate needs "is this document a near copy of one kept before
it", decided shard by shard so a shard can be quarantined and its documents left out of the index.
datasketch's in-memory index does exactly that; its memory grows with the documents indexed
(``benchmarks/near_duplicates.py`` measures it).
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate
from typing import Any

from kiln.errors import ContractError

NEAR_DUPLICATE_KIND = "datasketch.MinHashLSH"
_KEYS = {"kind": str, "column": str, "num_perm": int, "threshold": float, "shingle_words": int, "seed": int}
_INT_BOUNDS = {"num_perm": (2, 1024), "shingle_words": (1, 64), "seed": (0, 2**32 - 1)}
"""Bounds ``kiln contract check`` enforces: a signature costs num_perm 4-byte values per document (1024:
4 KiB), a shingle's work grows with its words, and datasketch seeds numpy, which takes 32-bit seeds."""
MINHASH_SCHEME = "affine32"
"""datasketch 2's permutation scheme (32-bit values, collision-free permutations); part of the settings key."""
_MAX_HASH = 0xFFFFFFFF
"""An empty ``affine32`` MinHash's values: all-max means "no shingle" (empty text), never a duplicate."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NearDuplicateSettings:
    """``meta.kiln.near_duplicates`` of a contract."""

    column: str = "text"
    """The text column compared."""
    num_perm: int = 128
    """MinHash permutations: signature length; more is a finer Jaccard estimate (error ~ 1/sqrt(num_perm))."""
    threshold: float = 0.8
    """Estimated Jaccard similarity of the shingle sets at or above which a later document is a near-duplicate."""
    shingle_words: int = 5
    """Words per shingle (datatrove's MinHash default)."""
    seed: int = 1
    """Seed of the MinHash permutations: part of what makes the result reproducible."""

    def __post_init__(self) -> None:
        problems = check_near_duplicate_settings({"kind": NEAR_DUPLICATE_KIND, **asdict(self)})
        if problems:
            raise ContractError("; ".join(problems))

    @classmethod
    def from_contract(cls, raw: dict[str, Any]) -> NearDuplicateSettings:
        problems = check_near_duplicate_settings(raw)
        if problems:
            raise ContractError("; ".join(problems))
        return cls(**{k: v for k, v in raw.items() if k not in ("kind", "description", "source")})

    @property
    def key(self) -> str:
        """Content address of the settings: signatures are comparable only under the same key."""
        body = json.dumps({"kind": NEAR_DUPLICATE_KIND, "scheme": MINHASH_SCHEME, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()[:16]


def check_near_duplicate_settings(raw: Any, where: str = "meta.kiln.near_duplicates") -> list[str]:
    """Every problem of a ``near_duplicates`` object, each naming its field."""
    if not isinstance(raw, dict):
        return [f"{where} must be an object"]
    problems = [f"{where}.{k} is not a setting (known: {sorted([*_KEYS, 'description', 'source'])})"
                for k in sorted(set(raw) - set(_KEYS) - {"description", "source"})]
    if raw.get("kind") != NEAR_DUPLICATE_KIND:
        problems.append(f"{where}.kind must be {NEAR_DUPLICATE_KIND!r}, got {raw.get('kind')!r}")
    for key, kind in _KEYS.items():
        if key == "kind" or key not in raw:
            continue
        value = raw[key]
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                problems.append(f"{where}.{key} must be a number in (0, 1], got {value!r}")
        elif kind is int:
            low, high = _INT_BOUNDS[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                problems.append(f"{where}.{key} must be an int in [{low}, {high}], got {value!r}"[:300])
        elif not isinstance(value, str) or not value:
            problems.append(f"{where}.{key} must be a non-empty string, got {value!r}")
    return problems


# -- signatures -----------------------------------------------------------------------------------------


def _simplified(text: str) -> str:
    """``datatrove.utils.text.simplify_text(text)``, skipping its slowest step where it is a no-op.

    The last step (NFD, then drop the combining marks) leaves an ASCII string unchanged: so the text is
    simplified without it first, and only a result that is not ASCII is simplified again in full."""
    from datatrove.utils.text import simplify_text

    simple = simplify_text(text, _no_diacritics_config())
    return simple if simple.isascii() else simplify_text(text)


def _no_diacritics_config() -> Any:
    """datatrove's default normalisation without its diacritics step (built on first use)."""
    global _NO_DIACRITICS
    if _NO_DIACRITICS is None:
        from dataclasses import replace

        from datatrove.utils.text import DEF_TEXT_NORM_CONFIG

        _NO_DIACRITICS = replace(DEF_TEXT_NORM_CONFIG, norm_unicode_diacritics=False)
    return _NO_DIACRITICS


_NO_DIACRITICS: Any = None


def shingles(text: str, words: int) -> list[bytes]:
    """The distinct shingles of a text (datatrove's MinHash normalisation), UTF-8 encoded, sorted."""
    return sorted(set(_shingle_list(text, words)))


def _shingle_list(text: str, words: int) -> list[bytes]:
    """Every shingle of a text in order, repeats included (a MinHash is the same over a list and its set).

    Each ``" ".join(tokens[i : i + words]).encode()`` is cut out of the whole text's UTF-8 bytes at its
    tokens' byte offsets instead of joined and encoded one by one."""
    tokens = _simplified(text).split()
    if not tokens:
        return []
    joined = " ".join(tokens).encode()
    if len(tokens) <= words:
        return [joined]
    lengths = list(map(len, tokens))
    if len(joined) != len(tokens) - 1 + sum(lengths):  # not ASCII: count the tokens' UTF-8 bytes
        lengths = list(map(len, map(str.encode, tokens)))
    # Token i starts at byte sum(lengths[:i]) + i (one space after each token before it).
    starts = list(map(operator.add, accumulate(lengths, initial=0), range(len(tokens) + 1)))
    return [joined[a : b - 1] for a, b in zip(starts, starts[words:], strict=False)]


def _sha1_hash32(parts: list[bytes]) -> Any:
    """``datasketch.hashfunc.sha1_hash32`` of every part (the first 4 bytes of its SHA-1, little-endian),
    as one ``uint32`` array: the digests are joined and read by numpy, not unpacked one by one."""
    import numpy as np

    sha1 = hashlib.sha1
    return np.frombuffer(b"".join([sha1(p).digest() for p in parts]), dtype="<u4")[::5]


def signatures(texts: Sequence[str | None], settings: NearDuplicateSettings) -> Any:
    """MinHash signatures of ``texts``, one row each (``numpy.uint32``, shape ``(len(texts), num_perm)``).

    A null or empty text (no shingle) gets the all-max row, which is never called a duplicate.

    Bit-identical to ``MinHash(num_perm, seed, scheme=MINHASH_SCHEME).update_batch(shingles(text))``
    with datasketch's default SHA-1 hash: the shingles' hashes are computed in one batch first
    (``_sha1_hash32``) and handed to datasketch's ``update_batch`` as the values its ``hashfunc``
    (here ``int``) returns; the permutations and the minimum are datasketch's own. Repeated shingles
    are not removed first: a minimum does not change when a value is seen twice."""
    import numpy as np
    from datasketch import MinHash

    out = np.full((len(texts), settings.num_perm), _MAX_HASH, dtype=np.uint32)
    # One MinHash, cleared per document (datasketch's clear(): copy() would build a new object each time).
    minhash = MinHash(num_perm=settings.num_perm, seed=settings.seed, scheme=MINHASH_SCHEME, hashfunc=int)
    for row, text in enumerate(texts):
        if not text:
            continue
        parts = _shingle_list(text, settings.shingle_words)
        if parts:
            minhash.clear()
            minhash.update_batch(_sha1_hash32(parts).tolist())
            out[row] = minhash.hashvalues
    return out


# -- the index ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NearDuplicate:
    """A document dropped as a near copy of one kept before it."""

    row: int
    of_shard: int
    """Index (in the order shards were offered) of the shard holding the kept copy."""
    of_row: int
    similarity: float
    """MinHash estimate of the Jaccard similarity of the two shingle sets."""


class NearDuplicateIndex:
    """The documents kept so far, offered shard by shard in a fixed order.

    ``check_shard`` finds the shard's near-duplicates (against earlier shards and earlier rows of the
    same shard) and indexes its other documents tentatively; ``accept`` keeps them, ``reject`` takes
    them out again (a quarantined shard keeps nothing from being trained on, so it must not make a
    later shard's copy look like a duplicate)."""

    def __init__(self, settings: NearDuplicateSettings) -> None:
        from datasketch import MinHashLSH

        self.settings = settings
        # datasketch names the dict storage's tables after a random string: it never changes a result.
        self._lsh = MinHashLSH(threshold=settings.threshold, num_perm=settings.num_perm)
        self._signatures: dict[int, Any] = {}
        self._pending: tuple[int, list[tuple[int, int]]] | None = None

    @property
    def documents(self) -> int:
        """Documents in the index (kept ones, plus the pending shard's)."""
        return len(self._lsh.keys)

    def check_shard(self, shard: int, signatures: Any, skip_rows: frozenset[int] = frozenset()) -> list[NearDuplicate]:
        """Near-duplicates of shard number ``shard`` (rows in ``skip_rows`` are neither checked nor indexed)."""
        import numpy as np
        from datasketch import LeanMinHash

        if self._pending is not None:
            raise RuntimeError("accept() or reject() the previous shard first")
        if shard in self._signatures:
            raise ValueError(f"shard {shard} was offered twice")
        signatures = np.asarray(signatures, dtype=np.uint32)
        if signatures.ndim != 2 or signatures.shape[1] != self.settings.num_perm:
            raise ValueError(f"signatures of shard {shard} have shape {signatures.shape}, "
                             f"expected (rows, {self.settings.num_perm})")
        self._signatures[shard] = signatures
        inserted: list[tuple[int, int]] = []
        found: list[NearDuplicate] = []
        seed = self.settings.seed
        for row in range(signatures.shape[0]):
            values = signatures[row]
            if row in skip_rows or bool((values == _MAX_HASH).all()):
                continue
            minhash = LeanMinHash(seed=seed, hashvalues=values, scheme=MINHASH_SCHEME)
            best: tuple[float, int, int] | None = None
            for other_shard, other_row in self._lsh.query(minhash):
                kept = LeanMinHash(seed=seed, hashvalues=self._signatures[other_shard][other_row], scheme=MINHASH_SCHEME)
                similarity = float(minhash.jaccard(kept))
                # The earliest kept copy among those similar enough: the index's set order must not decide.
                if similarity >= self.settings.threshold and (best is None or (other_shard, other_row) < (best[1], best[2])):
                    best = (similarity, other_shard, other_row)
            if best is not None:
                found.append(NearDuplicate(row=row, of_shard=best[1], of_row=best[2], similarity=round(best[0], 4)))
                continue
            self._lsh.insert((shard, row), minhash, check_duplication=False)
            inserted.append((shard, row))
        self._pending = (shard, inserted)
        return found

    def accept(self) -> None:
        self._pending = None

    def reject(self) -> None:
        """Take the pending shard's documents out of the index."""
        if self._pending is None:
            return
        shard, inserted = self._pending
        for key in inserted:
            self._lsh.remove(key)
        del self._signatures[shard]
        self._pending = None
