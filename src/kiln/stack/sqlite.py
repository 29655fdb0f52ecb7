"""Connection arguments of the embedded stack's SQLite metadata database, named by import path in
Airflow's ``[database] sql_alchemy_connect_args`` and ``sql_alchemy_connect_args_async``.

SQLite lets one connection write at a time; the others wait for the lock, and Python's ``sqlite3``
(and ``aiosqlite``, which passes its arguments to it) waits 5 s by default before it fails with
"database is locked". On a loaded 2-core machine a scheduler transaction has held the lock longer
than that: the api-server then answered a user's PATCH of a DAG run with HTTP 500 (``INSERT INTO
log`` could not get the lock), and the run the user meant to end went on. Waiting up to a minute
turns that into a slow answer instead of a lost write. A deployment runs on PostgreSQL, where
writers do not take the whole database (``kiln.stack.prodlike``, ``docker/``).
"""

from __future__ import annotations

from typing import Any

LOCK_TIMEOUT_S = 60.0
"""How long a connection waits for SQLite's write lock before "database is locked"."""

SYNC: dict[str, Any] = {"timeout": LOCK_TIMEOUT_S}
"""``sqlite3.connect`` arguments of Airflow's engine (Airflow adds ``check_same_thread`` itself)."""
ASYNC: dict[str, Any] = {"timeout": LOCK_TIMEOUT_S}
"""``aiosqlite.connect`` arguments of Airflow's async engine (the api-server's execution API)."""
