#!/usr/bin/env bash
# The CPU evidence in benchmark/results/: Breakout, 500k steps, same global batch (8 envs x
# 128 steps), (a) 2 ranks x 4 envs under torchrun vs (b) 1 process x 8 envs. Run from the repo root:
#   bash benchmark/evidence_cpu.sh [seeds...]        (default: seed 1)
# then: python benchmark/plot.py --runs-dir runs --out-dir benchmark/results
set -euo pipefail
for seed in "${@:-1}"; do
  torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py --no-cuda --local-num-envs 4 \
    --total-timesteps 500000 --seed "$seed" --exp-name ddp_2x4 &
  # --threads 1: two torch threads beside the 2-rank run would oversubscribe the 2 cores
  python ppo_atari_multigpu.py --no-cuda --local-num-envs 8 --total-timesteps 500000 \
    --seed "$seed" --exp-name single_1x8 --threads 1 --save-interval 10 --resume auto &
  wait
done
