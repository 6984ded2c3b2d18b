#!/usr/bin/env bash
# A published-scale run (10M steps) that outlives the shell and the session that started it:
#   bash benchmark/long_run.sh GAME SEED [extra trainer flags]      start, or continue
#   bash benchmark/long_run.sh --stop GAME SEED                       preempt: save, exit 75
#   bash benchmark/long_run.sh --keep GAME SEED                       copy results into the repo
# The README's launch (2 ranks x 4 envs on the CPU, CleanRL's defaults, --resume auto; torchrun
# as `$PYTHON -m torch.distributed.run`, PYTHON defaulting to python3), at low
# priority, detached (setsid + nohup), in LONG_RUN_DIR/GAME_sSEED (default /work/long_runs): outside
# the checkout, so a fresh clone neither carries nor deletes it. Every launch appends a line with
# its date, commit and command to launches.log; the trainer's output goes to train.log.
# --keep copies the events, logs, the newest checkpoint (20 MB; older kept ones are removed) and
# (at the end) the model file to benchmark/results/long_runs/GAME_sSEED/, what a commit keeps: a
# session's run directory does not outlive the machine. A launch whose run directory is gone
# starts from the checkpoint kept there, else from step 0.
# With the kernel's sched_autogroup on (the default), nice only ranks processes within their
# session: `echo 0 > /proc/sys/kernel/sched_autogroup_enabled` lets other work come first.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
mode=run
case "${1:-}" in --stop | --keep) mode=${1#--} && shift ;; esac
[ $# -ge 2 ] || { sed -n 2,5p "$0" >&2; exit 2; }
game=$1 seed=$2
shift 2
name="${game}_s${seed}"
dir="${LONG_RUN_DIR:-/work/long_runs}/$name"
kept="$repo/benchmark/results/long_runs/$name"
run_name="${game}__long__${seed}"

if [ "$mode" = stop ]; then
  # torchrun forwards SIGTERM to its workers: they finish the iteration, rank 0 saves, all exit 75
  pid=$(cat "$dir/torchrun.pid")
  kill -TERM "$pid" && echo "sent SIGTERM to torchrun $pid; wait for 'exit 75' in $dir/train.log"
  exit 0
fi

if [ "$mode" = keep ]; then
  mkdir -p "$kept"
  cp "$dir"/launches.log "$dir"/train.log "$kept"/
  cp "$dir/runs/$run_name"/events.out.tfevents.* "$kept"/ 2>/dev/null || true
  cp "$dir/runs/$run_name"/*.model "$kept"/ 2>/dev/null || true
  newest=$(ls "$dir/runs/$run_name/checkpoints"/ckpt_*.pt 2>/dev/null | sort | tail -n 1)
  if [ -n "$newest" ]; then
    find "$kept" -name 'ckpt_*.pt' ! -name "$(basename "$newest")" -delete
    cp "$newest" "$kept"/
  fi
  ls -la "$kept"
  exit 0
fi

mkdir -p "$dir/runs/$run_name/checkpoints"
cd "$dir"
if [ -f torchrun.pid ] && kill -0 "$(cat torchrun.pid)" 2>/dev/null; then
  echo "already running (torchrun pid $(cat torchrun.pid)); tail -f $dir/train.log" >&2
  exit 1
fi
if ! ls "runs/$run_name/checkpoints"/ckpt_*.pt >/dev/null 2>&1; then
  if ls "$kept"/ckpt_*.pt >/dev/null 2>&1; then  # a new machine: continue from what was kept
    cp "$kept"/ckpt_*.pt "runs/$run_name/checkpoints/"
    cp "$kept"/events.out.tfevents.* "runs/$run_name/" 2>/dev/null || true
    cp "$kept"/launches.log "$kept"/train.log . 2>/dev/null || true
    echo "# $(date -u +%FT%TZ) run directory seeded from $kept" >> launches.log
  fi
fi
cmd=("${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc_per_node=2
  "$repo/ppo_atari_multigpu.py" --no-cuda
  --env-id "$game" --seed "$seed" --local-num-envs 4 --total-timesteps 10000000
  --exp-name long --run-name "$run_name" --resume auto --save-minutes 10 --print-every 60 "$@")
echo "$(date -u +%FT%TZ) $(git -C "$repo" rev-parse --short HEAD) ${cmd[*]}" >> launches.log
setsid nohup nice -n 10 "${cmd[@]}" >> train.log 2>&1 < /dev/null &
echo $! > torchrun.pid
echo "started (pid $!): tail -f $dir/train.log"
