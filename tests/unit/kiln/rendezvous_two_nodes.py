"""Two nodes of torch's c10d rendezvous in one fresh interpreter, with the agents' patch
(``kiln.launchers.worker._whole_first_gang``): min 1, max 2, a last call of 1 s (torch's shortest).

Run by ``test_launchers`` as ``python rendezvous_two_nodes.py``; prints one JSON object: the world size
each ``next_rendezvous`` returned, or the error it raised with the shared rendezvous state at that
moment (participants, wait list, round), which is what a timeout needs to be read.

A fresh interpreter, not the test's process: an xdist worker carries every earlier test's threads and
patches, and the two nodes here are threads that share its GIL.
"""

from __future__ import annotations

import json
import pickle
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

# A generous join deadline costs nothing when the round completes (it is only a deadline): a thread
# starved of the CPU on a loaded 2-core machine must not fail the check. Heartbeats tolerate 15 s of
# silence in the first round (1 s x 15, torch's default tolerance of 5 s x 3 that real agents run
# with); each node drops every node whose heartbeats are that old, itself included.
JOIN_TIMEOUT_S = 240
FIRST_ROUND_TOLERANCE = 15
# The lost node is then dropped after 3 s rather than 15: the survivor's own tolerance is shortened
# for the later round (the settings torch reads its heartbeats against), so the check does not sit
# out torch's default. A survivor starved past it drops itself and joins again, which torch handles.
LATER_ROUND_TOLERANCE = 3


def _state(store: Any) -> dict[str, Any]:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    got = C10dRendezvousBackend(store, "elastic").get_state()
    if got is None:
        return {"state": None}
    state = pickle.loads(got[0])
    return {"round": state.round, "complete": state.complete, "closed": state.closed,
            "participants": sorted(str(n) for n in state.participants),
            "wait_list": sorted(str(n) for n in state.wait_list),
            "heartbeats": {str(n): t.isoformat() for n, t in state.last_heartbeats.items()}}


def main() -> int:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from kiln.launchers import worker

    worker._whole_first_gang()
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                      timeout=timedelta(seconds=60))
    probe = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=60))

    def handler() -> dr.DynamicRendezvousHandler:
        store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=60))
        params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{master.port}", run_id="elastic",
                                      min_nodes=1, max_nodes=2, last_call_timeout=1, join_timeout=JOIN_TIMEOUT_S,
                                      keep_alive_interval=1, keep_alive_max_attempt=FIRST_ROUND_TOLERANCE)
        return dr.create_handler(store, C10dRendezvousBackend(store, "elastic"), params)

    first, second = handler(), handler()
    out: dict[str, Any] = {}
    t0 = time.monotonic()

    def join(name: str, h: dr.DynamicRendezvousHandler) -> None:
        try:
            out[name] = h.next_rendezvous().world_size
        except Exception as exc:  # reported with the shared state, which is what the test reads
            out[name] = f"{type(exc).__name__} after {time.monotonic() - t0:.1f} s; state {_state(probe)}"

    early = threading.Thread(target=join, args=("first", first), daemon=True)
    early.start()
    time.sleep(2.0)  # torch's own rule (min 1, a last call of 1 s) would have completed a world of 1 by now
    join("second", second)
    early.join(timeout=JOIN_TIMEOUT_S + 10)
    if out.get("first") == 2 and out.get("second") == 2:
        second._stop_heartbeats()  # node lost: no more heartbeats, so the rendezvous drops it
        shorter = replace(first._settings, keep_alive_max_attempt=LATER_ROUND_TOLERANCE)
        for holder in (first, first._state_holder, first._op_executor):
            holder._settings = shorter
        join("again", first)
        first.shutdown()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
