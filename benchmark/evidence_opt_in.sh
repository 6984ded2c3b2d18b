#!/usr/bin/env bash
# Learning evidence for the speed opt-ins, next to evidence_cpu.sh's default ddp_2x4 run: Breakout,
# 500k steps, 2 ranks x 4 envs, default hyperparameters, one run at a time. From the repo root:
#   bash benchmark/evidence_opt_in.sh VARIANT [seeds...]      (default: seed 1)
#   VARIANT: bf16 | native | native_bf16_async | allreduce_fp16 | compile
# then: python benchmark/plot.py --runs-dir runs --out-dir benchmark/results
set -euo pipefail
variant=${1:?"usage: evidence_opt_in.sh bf16|native|native_bf16_async|allreduce_fp16|compile [seeds...]"}
shift
case "$variant" in
  bf16) flags=(--amp bf16) ;;
  native) flags=(--env-backend native) ;;
  native_bf16_async) flags=(--amp bf16 --env-backend native --async-envs) ;;
  allreduce_fp16) flags=(--allreduce-fp16) ;;
  compile) flags=(--compile) ;;
  *) echo "unknown variant '$variant' (bf16 | native | native_bf16_async | allreduce_fp16 | compile)" >&2; exit 2 ;;
esac
for seed in "${@:-1}"; do
  torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py --no-cuda --local-num-envs 4 \
    --total-timesteps 500000 --seed "$seed" --exp-name "ddp_2x4_$variant" "${flags[@]}"
done
