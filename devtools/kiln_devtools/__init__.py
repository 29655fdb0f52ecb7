"""kiln's test and development tooling, kept out of the installed package.

    chaos           the seeded fault-injection suite (``make chaos``; a fixed-seed subset in tests/chaos)
    slurm_cluster   a real 2-node Slurm cluster on localhost for the tests (slurmctld, slurmd, munged)

Run from a checkout: the Makefile and pytest put ``devtools/`` on the path (``PYTHONPATH=devtools``).
"""
