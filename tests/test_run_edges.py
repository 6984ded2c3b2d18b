"""Issue 41's edges of long runs: a run preempted in its last iteration, a finished run extended to
a larger total, a user's own file among the checkpoints, an old checkpoint that cannot be removed,
bit rot inside a checkpoint (a requeue at another world size: test_checkpoints' world-size test).
Every fault is real: real files, a real SIGTERM in the run's last iteration."""

import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import SCRIPT, TINY, scalar_tags, torchrun

import ppo_atari_multigpu as ppo

FLAGS = ["--total-timesteps", 128, "--save-interval", 1, "--eval-episodes", 0]  # 2 iterations
SPANS = "the learning-rate schedule now spans the new total"
GLOBAL_SIZES = " ".join(TINY).replace("--local-num-envs 2", "").split()  # for --num-envs N


def run(cwd, *flags, wrapper=None, sizes=TINY):
    """The trainer's CompletedProcess in cwd: plain python, or under a wrapper script."""
    cmd = [sys.executable, *([str(wrapper)] if wrapper else []), str(SCRIPT)]
    return subprocess.run(
        [*cmd, *sizes, *map(str, flags)],
        cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---- killed after its last checkpoint; a finished run extended; flags that differ ----
# The process SIGKILLs itself as it prints the summary: after the final checkpoint, before the
# model file is written (the summary comes between them).
KILLED_BEFORE_THE_MODEL = """import builtins, os, runpy, signal, sys
print_ = builtins.print
def print_then_die(*args, **kwargs):
    print_(*args, **kwargs)
    if args and str(args[0]).startswith("done: "):
        os.kill(os.getpid(), signal.SIGKILL)
builtins.print = print_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def extended_run(tmp_path_factory):
    """One `--resume auto` run (no --run-name): killed after its final checkpoint, requeued with the
    same command, extended to 256 steps by the same command and to 384 with --run-name, then
    launched with --run-name and other flags. Returns cwd, its run name, the outputs, and what
    the run directory held after the kill and after the requeue."""
    cwd = tmp_path_factory.mktemp("extended")
    (cwd / "die.py").write_text(KILLED_BEFORE_THE_MODEL)
    auto = ["--save-interval", 1, "--keep-checkpoints", 2, "--resume", "auto"]
    first = [*auto, "--total-timesteps", 128, "--eval-episodes", 1]
    outs = {"killed": run(cwd, *first, wrapper=cwd / "die.py")}
    (name,) = os.listdir(cwd / "runs")
    model = cwd / "runs" / name / "ppo_atari_multigpu.model"
    held = {"killed": [*os.listdir(cwd / "runs" / name), *os.listdir(model.parent / "checkpoints")]}
    outs["requeued"] = run(cwd, *first)
    held["requeued"] = sorted(os.listdir(cwd / "runs" / name))
    final = cwd / "runs" / name / "checkpoints/ckpt_000000000128.pt"  # the total: 2 x 64 steps
    weights = [torch.load(p, weights_only=True) for p in (model, final) if p.exists()]
    outs["extended"] = run(cwd, *auto, "--total-timesteps", 256, "--eval-episodes", 0)
    by_name = [*auto, "--run-name", name, "--eval-episodes", 0]
    outs["by_name"] = run(cwd, *by_name, "--total-timesteps", 384)
    other = [*by_name, "--total-timesteps", 384, "--learning-rate", 0.001, "--num-envs", 4]
    outs["other_flags"] = run(cwd, *other, sizes=GLOBAL_SIZES)
    return cwd, name, outs, held, weights


def test_a_run_killed_after_its_final_checkpoint_saves_its_model_and_evaluates_when_requeued(
    extended_run,
):
    cwd, name, outs, held, weights = extended_run
    killed, requeued = outs["killed"], outs["requeued"]
    assert killed.returncode == -9 and "done: 128 steps" in killed.stdout, killed.stderr[-2000:]
    assert "ckpt_000000000128.pt" in held["killed"]
    assert "ppo_atari_multigpu.model" not in held["killed"]
    assert requeued.returncode == 0, requeued.stdout[-2000:] + requeued.stderr[-2000:]
    assert "nothing to do" not in requeued.stdout and "iter " not in requeued.stdout
    assert "done: 128 steps" in requeued.stdout and "replicas identical: True" in requeued.stdout
    assert f"eval runs/{name}/ppo_atari_multigpu.model: 1 episodes" in requeued.stdout
    assert "ppo_atari_multigpu.model" in held["requeued"]
    model, saved = weights[0], weights[1]["model"]  # the model file: the final checkpoint's
    assert model.keys() == saved.keys() and all(torch.equal(model[k], saved[k]) for k in saved)


def test_a_finished_run_continues_to_a_larger_total_by_its_auto_name_and_by_run_name(extended_run):
    cwd, name, outs, _, _ = extended_run
    for out, was, total in ((outs["extended"], 128, 256), (outs["by_name"], 256, 384)):
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        resumed = f"resumed runs/{name}/checkpoints/ckpt_{was:012d}.pt: iteration {was // 64 + 1}"
        assert resumed in out.stdout
        (span,) = [x for x in out.stdout.splitlines() if "-timesteps" in x]  # one line
        assert span == f"--total-timesteps {was} -> {total}: {SPANS}"
        assert f"iter {total // 64}/{total // 64} " in out.stdout and "warning" not in out.stdout
    assert os.listdir(cwd / "runs") == [name]  # the same command found the same run
    tags = scalar_tags(cwd / "runs" / name)
    assert [s for s, _ in tags["charts/SPS"]] == list(range(64, 385, 64))  # each step once
    lr = dict(tags["charts/learning_rate"])  # annealed to 0 over the total of the latest launch
    assert lr[192] == pytest.approx(2.5e-4 * (1 - 2 / 4)) and lr[256] == pytest.approx(0.625e-4)
    assert lr[320] == pytest.approx(2.5e-4 * (1 - 4 / 6))


def test_a_resume_with_other_flags_names_only_real_flags_and_a_shared_mismatch_once(extended_run):
    out = extended_run[2]["other_flags"]
    assert out.returncode == 2
    text = out.stdout + out.stderr
    (line,) = [x for x in text.splitlines() if "trained with other flags" in x]
    assert "(--learning-rate 0.00025 -> 0.001, --num-envs 2 -> 4)" in line
    for derived in ("--batch-size", "--minibatch-size", "--num-iterations", "--world-size"):
        assert derived not in text  # not flags: --num-envs and --num-steps make them
    assert "error: no checkpoint in" in out.stderr  # the files are listed, nothing overwritten


# ---- a signal in the rollout saves at once; a slow final save on rank 0 ----
# The process sends itself SIGTERM in its 37th env step: step 5 of iteration 2's 32.
SIGTERM_IN_A_ROLLOUT = """import atexit, os, runpy, signal, sys
import gymnasium as gym
step, calls = gym.vector.SyncVectorEnv.step, []
def step_then_sigterm(self, actions):
    calls.append(1)
    if len(calls) == 37:
        os.kill(os.getpid(), signal.SIGTERM)
    return step(self, actions)
gym.vector.SyncVectorEnv.step = step_then_sigterm
atexit.register(lambda: print("env steps:", len(calls)))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
FIRST_SAVE = (
    r"saved runs/r/checkpoints/ckpt_000000000064\.pt in \d+\.\d s: a preemption needs the "
    r"update's \d+\.\d s \+ this save \(torchrun --shutdown-timeout, default 30 s\)"
)


def test_a_signal_in_the_rollout_stops_it_at_its_next_step_and_saves_the_last_update(tmp_path):
    (tmp_path / "sigterm.py").write_text(SIGTERM_IN_A_ROLLOUT)
    out = run(tmp_path, *FLAGS, "--run-name", "r", wrapper=tmp_path / "sigterm.py")
    assert out.returncode == ppo.PREEMPTED, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "env steps: 37" in lines  # the step the signal came in, then no other
    saved = "runs/r/checkpoints/ckpt_000000000064.pt"  # iteration 1's: iteration 2 is discarded
    assert any(x.startswith(f"preempted (rank 0: SIGTERM): saved {saved}; exit 75") for x in lines)
    assert not any(x.startswith("iter 2/") for x in lines)
    assert torch.load(tmp_path / saved, weights_only=True)["global_step"] == 64
    # the first save says how long a preemption's grace must be
    assert len([x for x in lines if re.fullmatch(FIRST_SAVE, x)]) == 1, out.stdout[-2000:]


# Rank 0's first fsync, its final checkpoint's, takes 12 s (a slow network disk): longer than the
# failure board's silence limit (--pg-timeout / 2: 8 s), shorter than a collective's --pg-timeout.
SLOW_FIRST_FSYNC = """#!/bin/sh
if [ "$RANK" = 0 ]; then
  exec strace -qq -f --seccomp-bpf -o /dev/null -e trace=fsync \\
    -e inject=fsync:delay_enter=12s:when=1 "$@"
fi
exec "$@"
"""


def test_a_final_save_slower_than_the_silence_limit_ends_the_run_normally(tmp_path):
    wrapper = tmp_path / "slow_fsync.sh"
    wrapper.write_text(SLOW_FIRST_FSYNC)
    wrapper.chmod(0o755)
    flags = [*TINY, "--total-timesteps", 256, "--save-interval", 0, "--eval-episodes", 0]
    flags += ["--pg-timeout", 16, "--run-name", "r"]
    cmd = [*torchrun(2, "--no-python", script=wrapper), sys.executable, str(SCRIPT)]
    out = subprocess.run(
        [*cmd, *map(str, flags)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    final = r"saved runs/r/checkpoints/ckpt_000000000256\.pt in (\d+\.\d) s"
    (took,) = re.findall(final, out.stdout)
    assert float(took) >= 12  # the fault was real: rank 0 saved for longer than the limit
    assert "error" not in out.stderr, out.stderr[-3000:]
    assert (tmp_path / "runs/r/ppo_atari_multigpu.model").is_file()


# ---- a user's own file; an old checkpoint that cannot be removed; bit rot ----
BLOCKER = "ckpt_000000000001.pt"  # a directory where an old checkpoint would be


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory):
    """A finished run (checkpoints at steps 64 and 128, keeping 2) whose checkpoints directory
    held a directory named like a checkpoint older than them: the last save's prune cannot remove
    it."""
    cwd = tmp_path_factory.mktemp("pruned")
    (cwd / "runs/p/checkpoints" / BLOCKER).mkdir(parents=True)
    return cwd, run(cwd, *FLAGS, "--keep-checkpoints", 2, "--run-name", "p")


def test_an_old_checkpoint_that_cannot_be_removed_warns_naming_it_and_the_save_counts(pruned_run):
    cwd, out = pruned_run
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if BLOCKER in x]
    blocker = f"runs/p/checkpoints/{BLOCKER}"
    assert line.startswith(f"warning: old checkpoint {blocker} was not removed: [Errno 21] ")
    assert "not saved" not in out.stderr and "done: 128 steps" in out.stdout
    names = ["ckpt_000000000064.pt", "ckpt_000000000128.pt"]
    assert sorted(os.listdir(cwd / "runs/p/checkpoints")) == [BLOCKER, *names]


def test_a_users_own_file_among_the_checkpoints_is_none_of_them_and_never_pruned(
    tmp_path, pruned_run
):
    ckpts = tmp_path / "runs/u/checkpoints"
    ckpts.mkdir(parents=True)
    best = ckpts / "ckpt_best.pt"  # a real checkpoint the user kept under a name of their own
    shutil.copy(pruned_run[0] / "runs/p/checkpoints/ckpt_000000000064.pt", best)
    kept = best.read_bytes()
    out = run(tmp_path, *FLAGS, "--keep-checkpoints", 1, "--run-name", "u", "--resume", "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed" not in out.stdout and "iter 2/2" in out.stdout  # not this run's: it starts
    assert sorted(os.listdir(ckpts)) == ["ckpt_000000000128.pt", "ckpt_best.pt"]  # 64: pruned
    assert best.read_bytes() == kept


def flip_a_bit_in_tensor_data(path):
    """Flip one bit in the middle of the largest tensor's bytes: inside a zip record's contents
    (torch stores them uncompressed), past the record's local header."""
    with zipfile.ZipFile(path) as archive:
        tensors = [r for r in archive.infolist() if "/data/" in r.filename]
    record = max(tensors, key=lambda r: r.file_size)
    assert record.compress_type == zipfile.ZIP_STORED and record.file_size > 1000
    with open(path, "r+b") as f:
        f.seek(record.header_offset + 26)  # the local header's name and extra field lengths
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = record.header_offset + 30 + name_len + extra_len + record.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_bit_in_a_checkpoints_tensor_data_is_damage_auto_falls_back_a_path_stops(
    tmp_path, pruned_run
):
    ckpts = tmp_path / "runs/p/checkpoints"
    ckpts.mkdir(parents=True)
    for step in (64, 128):  # the finished run's two checkpoints
        shutil.copy(pruned_run[0] / f"runs/p/checkpoints/ckpt_{step:012d}.pt", ckpts)
    damaged = "runs/p/checkpoints/ckpt_000000000128.pt"
    flip_a_bit_in_tensor_data(tmp_path / damaged)
    flags = [*FLAGS, "--keep-checkpoints", 2, "--run-name", "p", "--resume"]
    out = run(tmp_path, *flags, damaged)
    assert out.returncode == 2, out.stdout[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {damaged} is unreadable (damaged")
    out = run(tmp_path, *flags, "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [x for x in out.stdout.splitlines() if damaged in x and not x.startswith("saved ")]
    assert line.startswith(f"warning: skipped checkpoint {damaged} is unreadable (damaged")
    assert "resumed runs/p/checkpoints/ckpt_000000000064.pt: iteration 2" in out.stdout
    assert "iter 2/2" in out.stdout  # and the run ends, saving a sound checkpoint at the total
    assert ppo.load_checkpoint(str(tmp_path / damaged), ppo.Agent((4, 84, 84), 4))
