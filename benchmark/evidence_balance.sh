#!/usr/bin/env bash
# Learning evidence for --balance-envs under load, next to evidence_cpu.sh's default ddp_2x4 runs:
# Breakout, 500k steps, 2 ranks x 4 envs, default hyperparameters, as benchmark/uneven.py runs it:
# two torchrun nodes on loopback, rank k pinned to core k, a CPU hog on rank 1's core. From the
# repo root (needs taskset and 2 cores):
#   bash benchmark/evidence_balance.sh [seeds...]      (default: seed 1)
# then: python benchmark/plot.py --runs-dir runs --out-dir benchmark/results
set -euo pipefail
taskset -c 1 python -c 'while True: pass' &
hog=$!
trap 'kill $hog' EXIT
for seed in "${@:-1}"; do
  pids=()
  for node in 0 1; do
    taskset -c "$node" torchrun --nnodes=2 --nproc_per_node=1 --node-rank="$node" \
      --master-addr=127.0.0.1 --master-port=29650 ppo_atari_multigpu.py --no-cuda --num-envs 8 \
      --total-timesteps 500000 --seed "$seed" --exp-name ddp_2x4_balance_hog --balance-envs &
    pids+=($!)
  done
  wait "${pids[@]}"
done
