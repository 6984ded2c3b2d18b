#!/bin/bash
# benchmark/slurm.sbatch on a real SLURM: a one-node cluster on this machine, three tiny CPU runs.
#   sudo bash benchmark/slurm_check.sh [results.md]   # Debian/Ubuntu, root, no SLURM running yet
# Sets up: slurm-wlm and munge (apt-get, where missing), /etc/slurm/slurm.conf for this host
# (its CPUs, proctrack/linuxproc), munged, slurmctld and slurmd; all stopped at the end.
# Submits the README's script with a CPU header (sbatch --gpus-per-node=0 --cpus-per-task=N) and
# proves that
#   (a) the time limit's warning (TERM to the batch shell, what --signal=B:TERM@120 sends; here
#       `scancel --batch --signal=TERM`) arriving mid-run makes the trainer save, the job is
#       requeued, and the requeued job resumes from that checkpoint and ends at the total with
#       every iteration run once;
#   (b) a preemption-style TERM to the job's steps (`scancel --signal=TERM`, not the batch shell)
#       does the same, through the trainer's marker file;
#   (c) a TERM that comes before the launch requeues at once, without starting srun; the
#       requeued job, whose run never launched, starts afresh and completes;
# and that srun gives the task its CPUs (SRUN_CPUS_PER_TASK; the trainer's thread line).
# Writes a summary (date, versions, commands, outcomes) to $1 (default: stdout only).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
summary=${1:-/dev/null}
if [ "$summary" != /dev/null ]; then : >"$summary"; fi
cpus=$(nproc)
host=$(hostname -s)
work=$(mktemp -d /tmp/slurm_check.XXXXXX)
python_bin=$(dirname "$(readlink -f "$repo/.venv/bin/python")")  # its torchrun too
export PATH="$repo/.venv/bin:$python_bin:$PATH" TRAINER="$repo/ppo_atari_multigpu.py"
log() { echo "$*" | tee -a "$summary"; }

# ---- the cluster: one node, this machine ----
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get install -y slurm-wlm munge >/dev/null || exit 1
fi
if pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null; then
  echo "a SLURM already runs here: this check sets up its own" >&2
  exit 1
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /run/munge "$work/log"
chown munge:munge /run/munge
[ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key; }
cat >/etc/slurm/slurm.conf <<EOF
# written by benchmark/slurm_check.sh: a one-node cluster for its check
ClusterName=check
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=check Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
runuser -u munge -- munged || exit 1  # its pid: /run/munge/munged.pid
slurmctld -c || exit 1
slurmd || exit 1
stop_cluster() {  # our own daemons, by the pids they wrote
  scancel --quiet --user=root 2>/dev/null
  sleep 2
  for pid_file in "$work/slurmd.pid" "$work/slurmctld.pid" /run/munge/munged.pid; do
    if [ -s "$pid_file" ]; then kill "$(cat "$pid_file")" 2>/dev/null; fi
  done
}
trap stop_cluster EXIT
for _ in $(seq 30); do
  sinfo -h -o %t 2>/dev/null | grep -q idle && break
  sleep 1
done
sinfo -h -o "%P %D %c %t" | grep -q idle || { echo "the node never came up" >&2; exit 1; }

# ---- the runs: the README's script, its header adapted for CPUs on the command line ----
iterations=40
flags=(--no-cuda --env-id PongNoFrameskip-v4 --num-envs 4 --num-steps 16 --update-epochs 1
       --num-minibatches 2 --print-every 0 --save-interval 0 --eval-episodes 0 --async-envs
       --total-timesteps $((64 * iterations)))
submit=(sbatch --parsable --nodes=1 --gpus-per-node=0 --cpus-per-task="$cpus" --time=10)
cd "$work" || exit 1
state() { scontrol show job "$1" | grep -o "JobState=[A-Z_]*" | cut -d= -f2; }
restarts() { scontrol show job "$1" | grep -o "Restarts=[0-9]*" | cut -d= -f2; }
wait_until() {  # seconds, then a condition to poll
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 1
  done
}
in_output() { grep -q -- "$2" "slurm-$1.out" 2>/dev/null; }
is_state() { [ "$(state "$1")" = "$2" ]; }
requeued() { [ "$(restarts "$1")" = 1 ] && is_state "$1" PENDING; }
release() {  # a requeued job waits 2 minutes (SLURM's own delay): not what is checked here
  scontrol update JobId="$1" StartTime=now
}
ok=0
check() {  # a claim and its proof
  if "${@:2}"; then log "- ok: $1"; else log "- FAILED: $1"; ok=1; fi
}
each_iteration_once() {  # iter lines 1..N, each once, over both starts of the job
  local got
  got=$(grep -o "^iter [0-9]*/" "slurm-$1.out" | tr -dc '0-9\n' | sort -n | tr '\n' ' ')
  [ "$got" = "$(seq -s ' ' 1 "$iterations") " ]
}
# this check's runs only (another run of the same trainer may be going on this machine)
no_orphans() {
  ! pgrep -f "$TRAINER.*--num-envs 4 --num-steps 16" >/dev/null && ! pgrep -x slurmstepd >/dev/null
}

log "# benchmark/slurm.sbatch on a real SLURM ($(date -u +%Y-%m-%dT%H:%MZ))"
log ""
log "$(sinfo -V), $(munged -V 2>&1 | head -1), host $host: $cpus CPUs, torch"\
  "$(python -c 'import torch; print(torch.__version__)'), trainer $TRAINER"
log ""
log "Submitted as: \`${submit[*]} benchmark/slurm.sbatch ${flags[*]} --seed S\`"

# (a) and (b): a signal mid-run, then the requeued job resumes
for case in warning preemption; do
  seed=$([ "$case" = warning ] && echo 1 || echo 2)
  job=$("${submit[@]}" "$repo/benchmark/slurm.sbatch" "${flags[@]}" --seed "$seed") || exit 1
  wait_until 300 in_output "$job" "^iter 5/" || { log "job $job never got to iteration 5"; exit 1; }
  if [ "$case" = warning ]; then
    signal=(scancel --batch --signal=TERM "$job")  # what --signal=B:TERM@120 sends
  else
    signal=(scancel --signal=TERM "$job")  # the job's steps, as a preemption signals them
  fi
  "${signal[@]}"
  wait_until 120 requeued "$job"
  release "$job"
  wait_until 300 is_state "$job" COMPLETED
  log ""
  log "## ($case) job $job, seed $seed: \`${signal[*]}\` at iteration 5"
  log '```'
  grep -E "^(run |preempted|resumed|done:|warning|error)|requeueing|CANCELLED" "slurm-$job.out" \
    | cut -c1-200 | tee -a "$summary"
  log '```'
  check "the trainer saved on the signal" in_output "$job" "^preempted (rank 0: SIGTERM): saved"
  check "the script requeued the job" in_output "$job" "requeueing job $job"
  check "the requeued job resumed from that checkpoint" in_output "$job" "^resumed runs/"
  check "it ended at the total: state $(state "$job")" is_state "$job" COMPLETED
  check "every iteration ran once over the two starts" each_iteration_once "$job"
done

# (c) a signal before the launch: a slow head-node lookup (scontrol, delayed 5 s) holds it
mkdir -p slow
printf '#!/bin/bash\n[ "$1" = show ] && { touch "%s/looking-up"; sleep 5; }\nexec %s "$@"\n' \
  "$work" "$(command -v scontrol)" >slow/scontrol
chmod +x slow/scontrol
job=$(PATH="$work/slow:$PATH" "${submit[@]}" "$repo/benchmark/slurm.sbatch" "${flags[@]}" --seed 3)
wait_until 120 test -e looking-up || { log "job $job never started"; exit 1; }
scancel --batch --signal=TERM "$job"
wait_until 120 requeued "$job"
cp "slurm-$job.out" first-start.out  # all that the first start printed
requeued_at_once() {
  grep -q "signalled before the launch: requeueing job $job" first-start.out \
    && ! grep -Eq "torchrun|^run |^iter " first-start.out
}
release "$job"
wait_until 300 is_state "$job" COMPLETED
log ""
log "## (before launch) job $job, seed 3: \`scancel --batch --signal=TERM $job\` during the lookup"
log '```'
grep -E "requeueing|^error|CANCELLED|^done" "slurm-$job.out" | cut -c1-200 | tee -a "$summary"
log '```'
check "requeued at once, no srun started" requeued_at_once
check "the requeued job started afresh and completed: state $(state "$job")" \
  in_output "$job" "^done: "
sleep 3
check "no trainer or slurmstepd process left" no_orphans
exit "$ok"
