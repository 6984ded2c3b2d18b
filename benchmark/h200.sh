#!/usr/bin/env bash
# The GPU throughput check (issue: Throughput, part 4), ready for a lent H200 (<= 8 minutes):
# 1 rank x 8 envs and 4 ranks x 8 envs on ONE GPU (gloo: nccl refuses two ranks on one GPU),
# sync vs native env backend, amp none vs bf16. Writes benchmark/results/throughput-h200.md.
# Needs the packages of requirements*.txt on the machine (carry wheels if it has no registry).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python benchmark/throughput.py --gpu-set --host h200 --iterations 12 --repeats 2 --timeout 200 --only gpu "$@"
