"""The chaos suite: seeded fault injection against the real components, with figures.

One module per family of faults, each a ``Family`` (``kiln_devtools.chaos.core``) that the runner
(``python -m kiln_devtools.chaos``, ``make chaos``) and the tests (``tests/chaos/``) share:

    training        kill     SIGKILL of a worker / a whole node's agent, also mid checkpoint write
                    corrupt  truncated or bit-flipped committed checkpoint: resume and registration refuse it
    mlflow_faults   mlflow   MLflow server killed during registration or promotion, restarted
    data_faults     snapshot DVC remote unreachable during a snapshot, then back
                    poison   the poison zoo in random shard positions and combinations
    stragglers      straggler a slow rank injected: flagged; clean runs: no flag
    airflow_faults  scheduler the Airflow scheduler killed mid-run and restarted

Results, the report format and the replay rule: ``kiln_devtools.chaos.core`` and ``kiln_devtools.chaos.runner``.
"""
