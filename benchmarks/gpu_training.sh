#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_training.py): the production-size ranker's bf16 step (eager and compiled) at two
# batch sizes, pinflow's own training job on the GPU (preflight, checkpoint, SIGKILL, exact resume compared
# bitwise) and the input pipeline against the step; one JSON line at the end. About 6 minutes on one GPU.
#
#   benchmarks/gpu_training.sh                 # from the repository root, with .venv or python3 on PATH
#   DEVICE=cpu benchmarks/gpu_training.sh      # the rehearsal on CPU (tiny sizes): what the tests run
#   BATCHES=8192,32768 STEPS=30 benchmarks/gpu_training.sh
#
# Exit codes: 0 every check held, 1 a check failed, 75 no usable GPU (or a missing package: carry its wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$PY" benchmarks/gpu_training.py "$@"
