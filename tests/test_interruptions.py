"""Runs that users interrupt, damage or launch twice: Ctrl-C, a corrupt newest checkpoint, the same
run started again, a full disk or an unwritable run directory, and flags out of range."""

import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, SCRIPT, TINY, scalar_tags, torchrun

import ppo_atari_multigpu as ppo


def resolved(**flags):
    flags = {"total_timesteps": 640, "local_num_envs": 2, "num_steps": 32, **flags}
    return ppo.resolve_sizes(ppo.Args(**flags), 1)


def python(code, **kwargs):
    """A Python process that imports the trainer as a module (cwd: the caller's)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True, **kwargs)


# ---- Ctrl-C ----
def test_a_ctrl_c_is_noted_once_and_a_second_signal_exits_at_once_with_one_line():
    code = """if True:
        import os, signal, time
        import ppo_atari_multigpu as ppo
        p = ppo.Preemption(True)
        os.kill(os.getpid(), signal.SIGINT)  # one Ctrl-C, delivered twice (terminal, launcher)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.5)
        print("still running after", p.signalled, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # what torchrun sends on a second Ctrl-C
        time.sleep(30)
        print("not stopped")
    """
    proc = python(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == ppo.INTERRUPTED == 130, err
    assert out == "still running after SIGINT\n"
    assert err.strip().splitlines() == [
        "stopped at once (a second signal); the last checkpoint is intact"
    ]


@pytest.mark.parametrize(
    "signals, code, words",
    [
        (["rank 0: SIGINT"], 130, ["interrupted (rank 0: SIGINT): saved runs/r/c.pt; exit 130"]),
        (["rank 0: SIGINT", "rank 1: SIGTERM"], 75, ["preempted (rank 0: SIGINT, rank 1: SIG"]),
    ],
)
def test_a_stop_exits_130_for_ctrl_c_else_75_with_one_line_naming_the_command_that_continues(
    monkeypatch, capsys, signals, code, words
):
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # leave pytest's own handlers alone
    monkeypatch.setattr(sys, "argv", ["ppo_atari_multigpu.py", "--seed", "2"])
    with pytest.raises(SystemExit) as stop:
        ppo.Preemption(True).exit_after_save(signals, "runs/r/c.pt", resolved(run_name="r"), False)
    assert stop.value.code == code
    (line,) = capsys.readouterr().out.splitlines()
    assert all(w in line for w in words)
    # a fresh run (timestamped name) continues by name; an `auto` run with the same command
    assert line.endswith("python ppo_atari_multigpu.py --seed 2 --run-name r --resume auto")
    monkeypatch.setattr(sys, "argv", ["ppo_atari_multigpu.py", "--resume", "auto"])
    with pytest.raises(SystemExit):
        ppo.Preemption(True).exit_after_save(
            signals, None, resolved(run_name="a", resume="auto"), False
        )
    line = capsys.readouterr().out
    assert "not saved" in line and line.endswith(": python ppo_atari_multigpu.py --resume auto\n")


WRAPPER = """import os, signal, subprocess, sys
trainer = subprocess.Popen([sys.executable, *sys.argv[1:]])  # in our process group: it gets
signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun's SIGINT itself; we record its exit code
code = trainer.wait()
open(f"exit_code_rank{os.environ['RANK']}", "w").write(str(code))
sys.exit(code)
"""


def test_ctrl_c_under_torchrun_saves_exits_130_on_every_rank_and_the_run_resumes_exactly(
    tmp_path,
):
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    flags = [*TINY, "--total-timesteps", "1280", "--save-interval", "0", "--eval-episodes", "0"]
    flags += ["--resume", "auto"]
    err = open(tmp_path / "stderr.log", "w")
    cmd = [*torchrun(2, script=tmp_path / "wrapper.py"), str(SCRIPT), *flags]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
    )
    try:
        lines = []
        while not any(line.startswith("iter 2/") for line in lines):
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines) + (tmp_path / "stderr.log").read_text()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: to torchrun, which forwards it
        stdout, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stderr = (tmp_path / "stderr.log").read_text()
    codes = [(tmp_path / f"exit_code_rank{r}").read_text() for r in (0, 1)]
    assert codes == ["130", "130"], stdout + stderr
    (line,) = [x for x in stdout.splitlines() if x.startswith("interrupted")]
    assert "(rank 0: SIGINT, rank 1: SIGINT): saved runs/" in line
    assert line.endswith(f"continue with: torchrun ... {SCRIPT} {' '.join(flags)}")
    # no traceback of ours: torchrun prints its own SignalException, which no worker can prevent
    assert "KeyboardInterrupt" not in stderr and "error [rank" not in stderr
    assert stderr.count("Traceback") == stderr.count("SignalException: Process") == 1, stderr

    out = subprocess.run(
        [*torchrun(2), *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed" in out.stdout and "iter 10/10" in out.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    steps = [s for s, _ in scalar_tags(run_dir)["charts/SPS"]]
    assert steps == list(range(128, 1281, 128))  # exactly the requested steps, none twice


# ---- resume from the newest checkpoint that loads ----
def saved_run(tmp_path, monkeypatch, iterations, **flags):
    """A Checkpointer whose run saved a checkpoint at each of `iterations`, and its agent parts."""
    monkeypatch.chdir(tmp_path)
    args = resolved(**{"run_name": "r", "resume": "auto", "keep_checkpoints": 10, **flags})
    checkpointer = ppo.Checkpointer(args, "r", 0, 1)
    agent = ppo.Agent((4, 84, 84), 4)
    parts = (agent, torch.optim.Adam(agent.parameters()), torch.amp.GradScaler(enabled=False))
    paths = [checkpointer.maybe_save(i, i * 64, *parts, now=True) for i in iterations]
    return checkpointer, parts, paths


def test_auto_resume_skips_a_corrupt_or_unfitting_newest_checkpoint_with_one_line_each(
    tmp_path, monkeypatch, capsys
):
    checkpointer, parts, paths = saved_run(tmp_path, monkeypatch, [1, 2, 3])
    with open(paths[2], "r+b") as f:
        f.write(os.urandom(1000))  # 1,000 random bytes over the newest
    ckpt = torch.load(paths[1], weights_only=True)
    ckpt["args"]["learning_rate"] = 1.0  # the next newest belongs to another configuration
    del ckpt["digest"]  # (edited: with it the file would be damaged, not another configuration's)
    torch.save(ckpt, paths[1])
    assert checkpointer.resume(*parts) == 64
    out = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("saved ")]
    assert out[0].startswith(f"warning: skipped checkpoint {paths[2]} is unreadable")
    assert out[1].startswith(f"warning: skipped {paths[1]} was trained with other flags")
    assert out[2].startswith(f"resumed {paths[0]}: iteration 2, global step 64")


def test_auto_resume_stops_with_one_line_listing_every_file_when_none_loads(
    tmp_path, monkeypatch, capsys
):
    checkpointer, parts, paths = saved_run(tmp_path, monkeypatch, [1, 2])
    for path in paths:
        open(path, "wb").write(b"garbage")
    with pytest.raises(SystemExit) as stop:
        checkpointer.resume(*parts)
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    tried = "ckpt_000000000128.pt, ckpt_000000000064.pt"
    assert line.startswith(f"error: no checkpoint in runs/r/checkpoints loads (tried {tried}); ")
    assert "nothing was overwritten" in line  # and how to start over


def test_an_explicit_resume_path_still_stops_on_a_bad_file(tmp_path, monkeypatch, capsys):
    checkpointer, parts, paths = saved_run(tmp_path, monkeypatch, [1, 2])
    open(paths[1], "wb").write(b"garbage")
    checkpointer.args.resume = paths[1]  # an older good checkpoint exists: it is not used
    with pytest.raises(SystemExit) as stop:
        checkpointer.resume(*parts)
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: checkpoint {paths[1]} is unreadable")


# ---- a fresh start in a directory with old events ----
def test_a_fresh_start_over_the_events_of_a_run_that_never_saved_logs_each_step_once(
    run_trainer, tmp_path
):
    from torch.utils.tensorboard import SummaryWriter

    old = SummaryWriter(str(tmp_path / "runs/r"))  # a run that stopped before its first save
    for step in (64, 128, 192):
        old.add_scalar("charts/SPS", 1, step)
    old.close()
    time.sleep(1.1)  # event files are named by the second they were opened in
    flags = [*TINY, "--total-timesteps", "128", "--eval-episodes", "0", "--run-name", "r"]
    out = run_trainer(*flags, "--resume", "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed" not in out.stdout
    assert [s for s, v in scalar_tags(tmp_path / "runs/r")["charts/SPS"]] == [64, 128]


# ---- the same run twice ----
def test_a_second_launch_of_a_running_run_refuses_naming_the_holder_and_a_dead_one_holds_nothing(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    code = """if True:
        import ppo_atari_multigpu as ppo
        held = ppo.Checkpointer(ppo.Args(), "r", 0, 1)
        held.lock_run_dir()  # the lock lives as long as the Checkpointer (its open file)
        print("holding", flush=True)
        input()
    """
    holder = python(code, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == "holding\n"
        second = ppo.Checkpointer(ppo.Args(), "r", 0, 1)
        with pytest.raises(SystemExit) as stop:
            second.lock_run_dir()
        assert stop.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        holder_line = f"host {socket.gethostname()}, pid {holder.pid}"
        assert line == f"error: run r is already running ({holder_line} holds runs/r/lock)"
        assert (tmp_path / "runs/r/lock").read_text() == holder_line + "\n"  # untouched
    finally:
        holder.kill()  # SIGKILL: no chance to clean up, yet the kernel drops the lock
        holder.wait()
    second.lock_run_dir()
    me = f"host {socket.gethostname()}, pid {os.getpid()}\n"
    assert (tmp_path / "runs/r/lock").read_text() == me
    second.lock.close()


# ---- a full disk or an unwritable run directory ----
def test_a_run_directory_that_cannot_be_written_is_refused_at_start(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs/r").write_text("a file where the run directory should be")
    with pytest.raises(SystemExit) as stop:
        ppo.Checkpointer(ppo.Args(), "r", 0, 1).lock_run_dir()
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: cannot write the run directory runs/r: ")


def full_disk(obj, f, *args, **kwargs):
    f.write(b"the first bytes")  # then the disk is full
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_save_removes_its_temp_file_keeps_the_older_checkpoints_and_training_goes_on(
    tmp_path, monkeypatch, capsys
):
    checkpointer, parts, (first,) = saved_run(
        tmp_path, monkeypatch, [1], keep_checkpoints=1, save_interval=1
    )
    monkeypatch.setattr(torch, "save", full_disk)
    assert checkpointer.maybe_save(2, 128, *parts) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "warning: checkpoint at step 128 was not saved: [Errno 28] No space left on device; "
        "the next save tries again"
    )
    assert os.listdir(tmp_path / "runs/r/checkpoints") == ["ckpt_000000000064.pt"]
    loaded = ppo.load_checkpoint(first, parts[0])
    assert loaded["global_step"] == 64 and checkpointer.save_error is None
    # the final save's failure is not a warning: MAIN stops the run with it, naming the last good
    assert checkpointer.maybe_save(10, 640, *parts) is None
    assert capsys.readouterr().err == ""
    assert checkpointer.save_error == (
        "the final checkpoint at step 640 was not saved: [Errno 28] No space left on device; "
        "the last good one is runs/r/checkpoints/ckpt_000000000064.pt"
    )


FULL_DISK_RUN = """import errno, runpy, sys, torch
real_save = torch.save
def save(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and "optimizer" in obj:  # checkpoints only: the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_save(obj, f, *args, **kwargs)
torch.save = save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_on_a_full_disk_training_goes_on_and_a_failed_final_save_exits_with_one_line(
    run_trainer, tmp_path
):
    (tmp_path / "full_disk.py").write_text(FULL_DISK_RUN)
    flags = [*TINY, "--total-timesteps", "128", "--save-interval", "1", "--run-name", "r"]
    out = run_trainer(tmp_path / "full_disk.py", SCRIPT, *flags, launcher=[sys.executable])
    assert out.returncode == 1, out.stderr[-2000:]  # a failure of the run, not of its input
    assert "iter 2/2" in out.stdout and "done:" not in out.stdout
    lines = [x for x in out.stderr.splitlines() if "not saved" in x]
    assert len(lines) == 2
    assert lines[0] == (
        "warning: checkpoint at step 64 was not saved: [Errno 28] No space left on device; "
        "the next save tries again"
    )
    final = "error: the final checkpoint at step 128 was not saved: [Errno 28] No space left on"
    assert lines[1].startswith(final)
    assert "Traceback" not in out.stderr
    assert os.listdir(tmp_path / "runs/r/checkpoints") == []  # no partial file left behind


# ---- flags ----
def test_flags_without_effect_in_this_setting_say_so_in_one_line_each():
    assert ppo.check_args(ppo.Args(), 2) == []
    warnings = ppo.check_args(ppo.Args(cuda=False, device_ids=[1], pg_timeout=60.0), 1)
    assert warnings == [
        "warning: --device-ids has no effect with --no-cuda",
        "warning: --pg-timeout has no effect in a single process",
    ]
    assert ppo.check_args(ppo.Args(wandb_entity="me"), 1) == [
        "warning: --wandb-entity has no effect without --track"
    ]


def test_an_out_of_range_flag_stops_the_launch_with_one_line_before_any_env_is_built(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--gamma", "1.5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: --gamma must be in [0, 1], got 1.5"]
    assert out.stdout == "" and not (tmp_path / "runs").exists()
