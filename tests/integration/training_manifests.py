"""A real TrainingManifest over two small Parquet shards of stdlib source, for launcher tests."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.refs import canonical_json


def _shard(path: Path, docs: list[tuple[str, str]]) -> dict:
    pq.write_table(pa.table({"doc_id": [n for n, _ in docs], "text": [t for _, t in docs],
                             "source": ["stdlib"] * len(docs)}), path)
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "rows": len(docs)}


def stdlib_manifest(root: Path, max_chars: int) -> Path:
    """Write two training shards (~``max_chars`` of text) and an eval shard under ``root``; return the manifest."""
    docs, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        docs.append((path.name, path.read_text(encoding="utf-8", errors="replace")))
        total += len(docs[-1][1])
        if total > max_chars:
            break
    body = {"snapshot_id": "0123456789abcdef0123456789abcdef.dir", "corpus": "stdlib-py", "contract": "stdlib-py@1",
            "shards": [_shard(root / f"train-{i}.parquet", docs[i::2]) for i in range(2)],
            "eval_shards": [_shard(root / "eval.parquet", docs[:3])], "quarantined": []}
    out = root / "manifest.json"
    out.write_text(json.dumps({"kind": "kiln.TrainingManifest", **body,
                               "sha256": hashlib.sha256(canonical_json(body)).hexdigest()}))
    return out
