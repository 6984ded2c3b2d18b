"""Issue 41's edges of long runs: a run preempted in its last iteration, a finished run extended to
a larger total, a user's own file among the checkpoints, an old checkpoint that cannot be removed,
bit rot inside a checkpoint (a requeue at another world size: test_checkpoints' world-size test).
Every fault is real: real files, a real SIGTERM in the run's last iteration."""

import os
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import SCRIPT, TINY, scalar_tags

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


# ---- preempted in the last iteration; a finished run extended; flags that differ ----
# The process sends itself SIGTERM as iteration 1 of 2 prints its line: the signal is noted before
# the last iteration's report on any machine, so that iteration saves at the total and exits 75.
SIGTERM_IN_THE_LAST_ITERATION = """import builtins, os, runpy, signal, sys
print_ = builtins.print
def print_then_sigterm(*args, **kwargs):
    print_(*args, **kwargs)
    if args and str(args[0]).startswith("iter 1/2 "):
        os.kill(os.getpid(), signal.SIGTERM)
builtins.print = print_then_sigterm
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def extended_run(tmp_path_factory):
    """One `--resume auto` run (no --run-name): preempted in its last iteration, requeued with the
    same command, extended to 256 steps by the same command and to 384 with --run-name, then
    launched with --run-name and other flags. Returns cwd, its run name, the outputs, and what
    the run directory held after the preemption and after the requeue."""
    cwd = tmp_path_factory.mktemp("extended")
    (cwd / "preempt.py").write_text(SIGTERM_IN_THE_LAST_ITERATION)
    auto = ["--save-interval", 1, "--keep-checkpoints", 2, "--resume", "auto"]
    first = [*auto, "--total-timesteps", 128, "--eval-episodes", 1]
    outs = {"preempted": run(cwd, *first, wrapper=cwd / "preempt.py")}
    (name,) = os.listdir(cwd / "runs")
    model = cwd / "runs" / name / "ppo_atari_multigpu.model"
    held = {"preempted": sorted(os.listdir(cwd / "runs" / name))}
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


def test_a_run_preempted_in_its_last_iteration_saves_its_model_and_evaluates_when_requeued(
    extended_run,
):
    cwd, name, outs, held, weights = extended_run
    preempted, requeued = outs["preempted"], outs["requeued"]
    final = f"runs/{name}/checkpoints/ckpt_000000000128.pt"
    assert preempted.returncode == ppo.PREEMPTED, preempted.stderr[-2000:]
    assert f"preempted (rank 0: SIGTERM): saved {final}; exit 75" in preempted.stdout
    assert "ppo_atari_multigpu.model" not in held["preempted"]
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
    (line,) = [x for x in out.stdout.splitlines() if damaged in x]
    assert line.startswith(f"warning: skipped checkpoint {damaged} is unreadable (damaged")
    assert "resumed runs/p/checkpoints/ckpt_000000000064.pt: iteration 2" in out.stdout
    assert "iter 2/2" in out.stdout  # and the run ends, saving a sound checkpoint at the total
    assert ppo.load_checkpoint(str(tmp_path / damaged), ppo.Agent((4, 84, 84), 4))
