"""Issue 41's edges of long runs: a user's own file among the checkpoints, an old checkpoint that
cannot be removed and bit rot inside a checkpoint. Every fault is real: real files."""

import os
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
from conftest import SCRIPT, TINY, torchrun

import ppo_atari_multigpu as ppo

FLAGS = ["--total-timesteps", 128, "--save-interval", 1, "--eval-episodes", 0]  # 2 iterations


def run(cwd, *flags, nproc=None, wrapper=None, sizes=TINY):
    """The trainer's CompletedProcess in cwd: plain python, under a wrapper script, or torchrun."""
    if nproc is not None:
        cmd = torchrun(nproc)
    else:
        cmd = [sys.executable, *([str(wrapper)] if wrapper else []), str(SCRIPT)]
    return subprocess.run(
        [*cmd, *sizes, *map(str, flags)],
        cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )


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
