"""Run benchmarks and write docs/benchmarks.md (``make bench``, or ``make bench BENCH=name``).

Every ``benchmarks/*.py`` module (but this one) with a ``main() -> dict`` is a benchmark. Its dict
has at least ``name``, ``baseline`` and ``ratio`` (against that baseline, measured in the same run);
nested dicts become tables. Each result is stored with its date and machine in
``benchmarks/results/<module>.json`` (tracked), and docs/benchmarks.md is rendered from all stored
results, so running one benchmark never erases the others' figures. Never pass/fail thresholds.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"


STANDALONE = ("run", "__init__", "gpu_check")
"""Not benchmarks of make bench: this runner, and the GPU check (make gpu-check, on a CUDA machine)."""


def discover() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in STANDALONE and not p.stem.startswith("_"))


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def render(results: dict[str, dict]) -> str:
    out = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`benchmarks/run.py`) from `benchmarks/results/*.json`. Each figure is",
        "a ratio against a baseline measured in the same run; none of them is a pass/fail test (the",
        "machines are noisy).",
        "",
    ]
    for module, r in sorted(results.items()):
        out += [f"## {r['name']}", "", f"`benchmarks/{module}.py` — {r['when']} on {r['machine']}.", "",
                f"Baseline: {r['baseline']}.", "", "| figure | value |", "|---|---|"]
        for key, value in r.items():
            if key in ("name", "baseline", "when", "machine") or isinstance(value, dict):
                continue
            out.append(f"| {key} | {value} |")
        for key, value in r.items():
            if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
                columns = list(dict.fromkeys(c for row in value.values() for c in row))  # a table of rows
                out += ["", f"**{key}**", "", f"| | {' | '.join(columns)} |", f"|---|{'---|' * len(columns)}"]
                out += [f"| {k} | {' | '.join(str(row.get(c, '')) for c in columns)} |" for k, row in value.items()]
            elif isinstance(value, dict):
                out += ["", f"**{key}**", "", "| item | value |", "|---|---|"]
                out += [f"| {k} | {v} |" for k, v in value.items()]
        out.append("")
    return "\n".join(out) + "\n"


def write_docs() -> Path:
    results = {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}
    doc = REPO / "docs" / "benchmarks.md"
    doc.write_text(render(results))
    return doc


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or discover()
    unknown = sorted(set(names) - set(discover()))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; known: {discover()}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    RESULTS.mkdir(exist_ok=True)
    for name in names:
        print(f"== {name}", flush=True)
        load_before = os.getloadavg()[0]
        result = importlib.import_module(name).main()
        # Other work on the machine skews both sides of a ratio differently: record how busy it was.
        result["load_avg_1m"] = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        result["when"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        result["machine"] = machine()
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {write_docs()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
