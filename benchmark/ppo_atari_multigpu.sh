#!/usr/bin/env bash
# Reproduce the published table: Pong, BeamRider, Breakout (NoFrameskip-v4), 10M steps, seeds 1-3,
# data-parallel (2 ranks x 4 envs under torchrun) and the single-process baseline (1 x 8 envs),
# the same global batch. Run from the repo root on a GPU machine:
#   bash benchmark/ppo_atari_multigpu.sh   # runs them one after another (~4.5 h each on 1 GPU)
#   bash benchmark/ppo_atari_multigpu.sh --dry-run  # only prints the commands
# then: python benchmark/plot.py --runs-dir runs --out-dir benchmark/results
set -euo pipefail
run() { echo "$*"; [ "$DRY_RUN" = 1 ] || "$@"; }
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
for env_id in PongNoFrameskip-v4 BeamRiderNoFrameskip-v4 BreakoutNoFrameskip-v4; do
  for seed in 1 2 3; do
    run torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py --env-id "$env_id" \
      --seed "$seed" --local-num-envs 4 --total-timesteps 10000000 --exp-name ppo_atari_multigpu \
      --resume auto
    run python ppo_atari_multigpu.py --env-id "$env_id" --seed "$seed" \
      --local-num-envs 8 --total-timesteps 10000000 --exp-name ppo_atari --resume auto
  done
done
