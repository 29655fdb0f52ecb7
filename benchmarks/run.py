"""Run every benchmark in this folder and write docs/benchmarks.md (``make bench``).

Each benchmark module has ``main() -> dict`` returning at least ``name``, ``baseline`` and
``ratio`` (measured against that baseline in the same run). Figures are recorded with the date and
the machine; they are never pass/fail thresholds.
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
BENCHMARKS = ("demo_overhead",)


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
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def render(results: list[dict], when: str, where: str) -> str:
    out = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`benchmarks/run.py`). Each figure is a ratio against a baseline measured",
        "in the same run; none of them is a pass/fail test (the machines are noisy).",
        "",
        f"Latest run: {when} on {where}.",
        "",
    ]
    for r in results:
        out += [f"## {r['name']}", "", f"Baseline: {r['baseline']}.", "", "| figure | value |", "|---|---|"]
        for key, value in r.items():
            if key in ("name", "baseline") or isinstance(value, dict):
                continue
            out.append(f"| {key} | {value} |")
        for key, value in r.items():
            if isinstance(value, dict):
                out += ["", f"**{key}**", "", "| stage | seconds |", "|---|---|"]
                out += [f"| {k} | {v} |" for k, v in value.items()]
        out.append("")
    return "\n".join(out) + "\n"


def main() -> int:
    sys.path.insert(0, str(HERE))
    results = []
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        results.append(importlib.import_module(name).main())
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    doc = REPO / "docs" / "benchmarks.md"
    doc.write_text(render(results, when, machine()))
    (REPO / ".kiln").mkdir(exist_ok=True)
    (REPO / ".kiln" / "benchmarks.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
