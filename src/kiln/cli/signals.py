"""``kiln signals serve|show|queue-latency``: the Prometheus exporter of operational signals.

::

    kiln signals serve [--host 127.0.0.1] [--port 9469]   # /metrics for Prometheus, /healthz
    kiln signals show [--grep kiln_train_checkpoint_lag]   # one scrape on stdout (what Prometheus sees)
    kiln signals queue-latency                             # JSON: per DAG/pool/run type count, p50, p99, max

All read ``KILN_HOME`` (runs, quarantine reports, the Airflow listener's queue events); see
``kiln.signals``. ``KILN_SIGNALS_STALE_AFTER_S`` / ``KILN_SIGNALS_REPORT_WINDOW_S`` tune what counts
as current.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("signals", help="operational signals: Prometheus exporter, one-off scrape, queue latency")
    p.add_argument("action", choices=("serve", "show", "queue-latency"))
    p.add_argument("--host", default="127.0.0.1", help="serve: bind address (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=int(os.environ.get("KILN_SIGNALS_PORT", "9469")),
        help="serve: port (default $KILN_SIGNALS_PORT or 9469; 0 picks a free one)",
    )
    p.add_argument("--grep", default="", help="show: only lines containing this text")
    p.set_defaults(func=handler)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile (what a person checks an alert against, not an interpolated estimate)."""
    rank = min(len(sorted_values), max(1, math.ceil(q * len(sorted_values))))
    return sorted_values[rank - 1]


def handler(args: argparse.Namespace) -> int:
    from kiln import signals

    config = signals.SignalsConfig.from_env()
    if args.action == "serve":
        server = signals.make_server(config, args.host, args.port)
        print(f"kiln signals: serving http://{args.host}:{server.server_address[1]}/metrics from {config.home}",
              file=sys.stderr, flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        return 0
    if args.action == "show":
        for line in signals.render(config).splitlines():
            if args.grep in line:
                print(line)
        return 0
    events, bad = signals.read_queue_events(config.queue_events)
    lat = signals.queue_latencies(events)
    groups: dict[tuple[str, str, str], list[float]] = {}
    for q in lat.known:
        groups.setdefault((q.dag_id, q.pool, q.run_type), []).append(q.seconds)
    rows = []
    for (dag, pool, run_type), values in sorted(groups.items()):
        values.sort()
        rows.append({
            "dag": dag, "pool": pool, "run_type": run_type, "count": len(values),
            "p50_s": round(_quantile(values, 0.5), 3), "p99_s": round(_quantile(values, 0.99), 3),
            "max_s": round(values[-1], 3), "unknown": lat.unknown.get((dag, pool, run_type), 0),
        })
    print(json.dumps({"events": str(config.queue_events), "unreadable_lines": bad, "groups": rows}, indent=2))
    return 0
