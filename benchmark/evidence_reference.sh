#!/usr/bin/env bash
# The reference trainer's learning evidence, beside evidence_cpu.sh's runs: Breakout, 500k steps,
# CleanRL's ppo_atari_multigpu.py (its cleanrl_utils beside it) run by its own interpreter, as
# 2 ranks x 4 envs (2x4) or 1 rank x 8 envs (1x8), one run at a time. From the repo root:
#   bash benchmark/evidence_reference.sh REFERENCE_SCRIPT REFERENCE_PY 2x4|1x8 [seeds...]
# then: python benchmark/plot.py --runs-dir runs --out-dir benchmark/results
set -euo pipefail
usage="usage: evidence_reference.sh REFERENCE_SCRIPT REFERENCE_PY 2x4|1x8 [seeds...]"
[ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
script=$1 py=$2 layout=$3
shift 3
case "$layout" in
  2x4) ranks=2 envs=4 ;;
  1x8) ranks=1 envs=8 ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
for seed in "${@:-1}"; do
  OMP_NUM_THREADS=1 "$py" -m torch.distributed.run --standalone --nproc_per_node=$ranks \
    "$script" --no-cuda --env-id BreakoutNoFrameskip-v4 --local-num-envs $envs \
    --total-timesteps 500000 --seed "$seed" --exp-name "reference_$layout"
done
