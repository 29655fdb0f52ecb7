"""The embedded stack's Airflow waits for SQLite's write lock instead of failing after 5 s."""

from __future__ import annotations

import json
import subprocess
import sys


def test_every_airflow_process_of_the_embedded_stack_reads_the_lock_timeout(tmp_path, monkeypatch):
    """Read back through Airflow's own configuration, in a process with the stack's environment: the
    import paths resolve, and both engines (sync, and the api-server's async one) get the timeout."""
    from kiln import settings as kiln_settings
    from kiln.stack import embedded, sqlite

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    env = embedded.airflow_env(kiln_settings.load())
    probe = ("import json; from airflow import settings; "
             "print(json.dumps([settings._get_connect_args('sync'), settings._get_connect_args('async')]))")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    sync, async_ = json.loads(done.stdout.strip().splitlines()[-1])
    # (Airflow adds check_same_thread=False to the sync arguments itself.)
    assert sync["timeout"] == async_["timeout"] == sqlite.LOCK_TIMEOUT_S > 5  # sqlite3's default: 5 s


def test_the_timeout_is_what_sqlite3_waits_for_a_lock_another_connection_holds(tmp_path):
    """What the setting changes: a writer that finds the lock taken waits for it rather than failing
    at once (timeout 0 here stands for any wait shorter than the other transaction)."""
    import sqlite3
    import threading
    import time

    import pytest

    from kiln.stack import sqlite as stack_sqlite

    db = tmp_path / "airflow.db"
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE log (event TEXT)")
    holder.execute("BEGIN IMMEDIATE")  # takes the write lock, as a scheduler transaction does
    holder.execute("INSERT INTO log VALUES ('scheduler')")
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        sqlite3.connect(db, timeout=0).execute("INSERT INTO log VALUES ('api-server')")
    threading.Timer(1.0, lambda: holder.execute("COMMIT")).start()
    started = time.monotonic()
    writer = sqlite3.connect(db, **stack_sqlite.SYNC)
    writer.execute("INSERT INTO log VALUES ('api-server')")
    writer.commit()
    assert time.monotonic() - started >= 0.9
    assert [row[0] for row in writer.execute("SELECT event FROM log")] == ["scheduler", "api-server"]
