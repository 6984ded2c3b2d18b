"""Issue 41's edges of long runs: an old checkpoint that cannot be removed. Every fault is real:
real files."""

import os
import subprocess
import sys

import pytest
from conftest import SCRIPT, TINY, torchrun

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


# ---- an old checkpoint that cannot be removed ----
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
