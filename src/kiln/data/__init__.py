"""The data side of a run: from a corpus directory to the shards training may read.

    corpus       the stdlib sample corpus (sharded Parquet, an eval split, seeded poison)
    snapshot     DVC snapshots: immutable ids, a remote, restore from the remote alone
    contracts    versioned GE suites under data_contracts/ (pure JSON, no GE import)
    validation/  shards checked against a contract: quarantine, the data gate, the TrainingManifest

This ``__init__`` imports none of them, so importing one never pulls in another's dependencies (DVC, GE).
"""
