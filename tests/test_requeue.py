"""What a SLURM requeue meets (issue 42; benchmark/slurm.sbatch, proven on a real SLURM by
benchmark/slurm_check.sh): the marker a preempted run leaves for the script, a requeue that finds
no checkpoint, the lock of the job's earlier start, and the step-wide TERM reaching env workers.
Every fault is real: a real SIGTERM in a real run, a lock really held, real env worker processes."""

import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import SCRIPT, TINY

import ppo_atari_multigpu as ppo

# --async-envs: env workers that ignore TERM must not hold up the trainer's exit (an error's or a
# preemption's), which multiprocessing would make wait for them
FLAGS = [*TINY, "--total-timesteps", "128", "--eval-episodes", "0", "--resume", "auto"]
FLAGS += ["--async-envs"]


# The process sends itself SIGTERM in iteration 2's rollout: 2 env groups, each waited for once a
# step, 32 steps an iteration. The rollout stops; iteration 1's state (step 64) is saved.
SIGTERM_IN_AN_ASYNC_ROLLOUT = """import os, runpy, signal, sys
import gymnasium as gym
step_wait, calls = gym.vector.AsyncVectorEnv.step_wait, []
def wait_then_sigterm(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 70:
        os.kill(os.getpid(), signal.SIGTERM)
    return step_wait(self, *args, **kwargs)
gym.vector.AsyncVectorEnv.step_wait = wait_then_sigterm
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(cwd, *flags, wrapper=None, **env_vars):
    """The trainer's CompletedProcess in cwd as a SLURM job's task (job 77, env_vars on top)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONUNBUFFERED="1", SLURM_JOB_ID="77", **env_vars)
    cmd = [sys.executable, *([str(wrapper)] if wrapper else []), str(SCRIPT), *flags]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def hold_lock(cwd, line):
    """A process that holds runs/r/lock (flock) with `line` in it, as a dead node's lock on NFS
    stays held; it prints once it holds the lock and keeps it until killed."""
    code = f"""if True:
        import fcntl, os, sys
        os.makedirs("runs/r", exist_ok=True)
        lock = open("runs/r/lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print({line!r}, file=lock, flush=True)
        print("holding", flush=True)
        sys.stdin.read()
    """
    holder = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "holding\n"
    return holder


def test_a_preempted_run_leaves_the_marker_and_its_requeue_resumes_past_the_earlier_starts_lock(
    tmp_path,
):
    (tmp_path / "preempt.py").write_text(SIGTERM_IN_AN_ASYNC_ROLLOUT)
    marker = tmp_path / "slurm-77.preempted"
    first = run(
        tmp_path,
        *FLAGS,
        "--run-name",
        "r",
        wrapper=tmp_path / "preempt.py",
        SLURM_RESTART_COUNT="0",
        PPO_PREEMPTED_MARKER=str(marker),
    )
    assert first.returncode == ppo.PREEMPTED, first.stderr[-2000:]
    saved = "runs/r/checkpoints/ckpt_000000000064.pt"
    assert marker.read_text() == "rank 0: SIGTERM\n"  # the script requeues on it
    # the requeued start (restart 1) meets the lock of the first, whose node is gone but whose
    # lock stays held (NFS): it warns and goes on; the run ends at its total
    holder = hold_lock(tmp_path, "host gone, pid 1, slurm job 77 restart 0")
    try:
        requeued = run(tmp_path, *FLAGS, "--run-name", "r", SLURM_RESTART_COUNT="1")
    finally:
        holder.kill()
        holder.wait()
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    warning = "warning: runs/r/lock is held by an earlier start of this job "
    assert f"{warning}(host gone, pid 1, slurm job 77 restart 0): going on" in requeued.stderr
    assert f"resumed {saved}" in requeued.stdout and "done: 128 steps" in requeued.stdout


@pytest.mark.parametrize(
    "line, restart",
    [
        ("host h, pid 1, slurm job 77 restart 1", "1"),  # this very start, launched twice
        ("host h, pid 1, slurm job 78 restart 0", "1"),  # another job's run
        ("host h, pid 1", "1"),  # a run outside SLURM
    ],
)
def test_a_lock_held_by_this_start_another_job_or_no_job_still_refuses(
    tmp_path, monkeypatch, capsys, line, restart
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
    holder = hold_lock(tmp_path, line)
    try:
        with pytest.raises(SystemExit) as stop:
            ppo.Checkpointer(ppo.Args(), "r", 0, 1).lock_run_dir()
    finally:
        holder.kill()
        holder.wait()
    assert stop.value.code == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert error == f"error: run r is already running ({line} holds runs/r/lock)"


def test_the_lock_names_the_slurm_job_and_its_restart_count(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    checkpointer = ppo.Checkpointer(ppo.Args(), "r", 0, 1)
    checkpointer.lock_run_dir()
    me = f"host {socket.gethostname()}, pid {os.getpid()}, slurm job 77 restart 2\n"
    assert (tmp_path / "runs/r/lock").read_text() == me
    checkpointer.lock.close()


def test_a_requeued_job_that_finds_no_checkpoint_stops_and_says_so(tmp_path):
    # e.g. runs/ on the local disk of the node the job ran on before: no silent start from step 0
    out = run(tmp_path, *FLAGS, "--run-name", "r", SLURM_RESTART_COUNT="1", PPO_RESUME_EXPECTED="1")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error")]
    assert line.startswith("error: SLURM requeued this job; no rank finds a checkpoint in ")
    assert "--resume PATH" in line and "iter " not in out.stdout


def test_the_marker_is_left_on_a_preemption_only_not_on_a_ctrl_c(tmp_path, monkeypatch):
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # leave pytest's own handlers alone
    monkeypatch.setenv("PPO_PREEMPTED_MARKER", str(tmp_path / "marker"))
    args = ppo.resolve_sizes(ppo.Args(run_name="r", local_num_envs=2, num_steps=32), 1)
    with pytest.raises(SystemExit) as stop:
        ppo.Preemption(False).exit_after_save(["rank 0: SIGINT"], None, args, False)
    assert stop.value.code == ppo.INTERRUPTED and not (tmp_path / "marker").exists()
    with pytest.raises(SystemExit) as stop:
        ppo.Preemption(False).exit_after_save(["rank 0: SIGUSR1"], None, args, False)
    assert stop.value.code == ppo.PREEMPTED
    assert (tmp_path / "marker").read_text() == "rank 0: SIGUSR1\n"


def test_env_workers_live_through_the_term_and_int_slurm_sends_every_process_of_a_step():
    args = ppo.resolve_sizes(ppo.Args(local_num_envs=2, async_envs=True, total_timesteps=256), 1)
    envs = ppo.RankEnvs(args, "t", False)  # two groups of one env, each in a worker process
    try:
        envs.reset([0, 1])
        workers = [p for env in envs.envs for p in env.processes]
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
            os.kill(worker.pid, signal.SIGINT)
        for env in envs.envs:  # every worker still answers
            assert env.step(np.zeros(1, dtype=np.int64))[0].shape == (1, 4, 84, 84)
        assert all(w.is_alive() for w in workers)
    finally:
        envs.close()
