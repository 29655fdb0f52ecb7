#!/usr/bin/env bash
# Entrypoint of kiln's trainer image: torchrun running kiln's worker (kiln.launchers.worker) on every
# rank, which runs the trainer the recipe names and, when a rank exits 2 (a fault a retry repeats),
# writes RUN/.launch/fatal/rank-N.json, the marker the launchers end the job on. Arguments go to the
# trainer (`--manifest M.json --recipe R.toml --run-dir RUN ...`).
#
# TORCHRUN_ARGS replaces the default single-node options, e.g. for node 0 of 2:
#   TORCHRUN_ARGS="--nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 --rdzv-id=RUN"
set -euo pipefail

# shellcheck disable=SC2206  # word splitting of TORCHRUN_ARGS is intended
torchrun_args=(${TORCHRUN_ARGS:---standalone --nproc-per-node=${NPROC_PER_NODE:-1}})
exec torchrun "${torchrun_args[@]}" -m kiln.launchers.worker "$@"
