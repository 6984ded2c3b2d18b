import glob
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "ppo_atari_multigpu.py"
sys.path.insert(0, str(ROOT))

# Tiny settings shared by the end-to-end runs: 2 envs x 32 steps, one epoch, two iterations, no
# final evaluation (10 games: ~3 s a run; a test of evaluation asks for it, the last flag wins).
TINY = (
    "--no-cuda --local-num-envs 2 --num-steps 32 --update-epochs 1 --num-minibatches 2 "
    "--eval-episodes 0 --print-every 0"  # a progress line every iteration: tests read them
).split()

# A failure must stop every rank at once instead of leaving a peer waiting in a collective until
# --pg-timeout. The runs that check it set this timeout and must end within half of it: how long
# they take otherwise depends on the machine, but no slow machine waits for the timeout.
PG_TIMEOUT = 600


def torchrun(nproc, *torchrun_flags, script=SCRIPT):
    """The command that starts `script` under torchrun on this machine with nproc ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc_per_node={nproc}", *torchrun_flags, str(script)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def inductor_cache(tmp_path_factory):
    """One inductor cache for the whole session (runs started by the tests inherit it): a graph
    one test compiled is not built again by the next. New in every session, so it never serves
    a kernel built under another ISA (torch 2.13's cache ignores ATEN_CPU_CAPABILITY)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor-cache")))
        yield


@pytest.fixture
def run_trainer(tmp_path):
    """Run the trainer (plain python or torchrun) in tmp_path; returns the CompletedProcess."""

    def run(*args, nproc=None, launcher=None, timeout=600):
        if launcher is not None:
            cmd = launcher
        elif nproc is None:
            cmd = [sys.executable, str(SCRIPT)]
        else:
            cmd = torchrun(nproc)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.run(
            cmd + [str(a) for a in args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


def assert_equal_to_rounding(actual, expected, rel=1e-5):
    """actual equals expected up to the rounding of float sums taken in another order (other
    kernels; the order also depends on the ISA and the thread count): every entry within rel x
    the largest |expected|, since a sum's rounding error scales with the terms summed, not with
    the result. A wrong value, or one not averaged over the ranks, is off by about its own size."""
    import torch

    atol = rel * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


def scalar_tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def worker_pids(launcher_pid):
    """{RANK: pid} of torchrun's worker processes: its children, by the RANK in their
    environment (read from /proc)."""
    found = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            pid, ppid = int(stat.split("/")[2]), int(open(stat).read().rsplit(")", 1)[1].split()[1])
            if ppid == launcher_pid:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                found[int([e for e in env if e.startswith(b"RANK=")][0][5:])] = pid
        except (OSError, IndexError, ValueError):
            pass
    return found
