"""Few, tiny end-to-end launches of the script: torchrun, plain python, two nodes, bad input."""

import subprocess
import sys
import time

import pytest
import torch
from conftest import PG_TIMEOUT, SCRIPT, TINY, free_port, scalar_tags

PARTS = ("env", "inference", "update", "allreduce")
CLEANRL_TAGS = [
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/learning_rate",
    "charts/SPS",
    "losses/value_loss",
    "losses/policy_loss",
    "losses/entropy",
    "losses/old_approx_kl",
    "losses/approx_kl",
    "losses/clipfrac",
    "losses/explained_variance",
]


def test_torchrun_two_ranks_with_tiny_target_kl_finishes_and_writes_cleanrl_tags(
    run_trainer, tmp_path
):
    # 2 ranks x 2 envs x 128 steps, 2 iterations: long enough for Breakout games to end.
    # A tiny --target-kl makes every rank stop after the first of 4 epochs: if the ranks disagreed,
    # one would enter the next epoch's all-reduce alone and the run would hang.
    out = run_trainer(
        *TINY,
        "--num-steps",
        "128",
        "--total-timesteps",
        "1024",
        "--target-kl",
        "1e-9",
        "--update-epochs",
        "4",
        "--run-name",
        "e2e",
        nproc=2,
    )
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-3000:]
    assert "iter 2/2" in out.stdout and "replicas identical: True" in out.stdout
    tags = scalar_tags(tmp_path / "runs" / "e2e")
    for tag in CLEANRL_TAGS:
        assert tag in tags, tag
    assert [s for s, _ in tags["charts/SPS"]] == [512, 1024]
    # perf/: every rank's seconds, shares of the iteration, memory, at every iteration; the
    # imbalance. How long each part takes is the machine's; how they relate is the code's.
    busy = []
    for rank in (0, 1):
        seconds = {
            part: [v for _, v in tags[f"perf/{part}_s/rank{rank}"]]
            for part in ("rollout", "env", "update", "allreduce")
        }
        assert [s for s, _ in tags[f"perf/rollout_s/rank{rank}"]] == [512, 1024]
        for it in range(2):
            t = {part: values[it] for part, values in seconds.items()}
            # env stepping is part of the rollout, the collectives part of the update
            assert 0 < t["env"] <= t["rollout"] and 0 < t["allreduce"] <= t["update"], t
            shares = {p: tags[f"perf/share_{p}/rank{rank}"][it][1] for p in PARTS}
            expected = {
                "env": t["env"],
                "inference": t["rollout"] - t["env"],
                "update": t["update"] - t["allreduce"],
                "allreduce": t["allreduce"],
            }
            for p in PARTS:  # the logged seconds split, as shares of the rank's iteration
                total = t["rollout"] + t["update"]
                assert abs(shares[p] - expected[p] / total) < 1e-5, (p, shares, t)
            assert abs(sum(shares.values()) - 1) < 1e-5, shares
            busy.append((rank, it, t["rollout"] + t["update"] - t["allreduce"]))
        assert all(0.05 < v < 64 for _, v in tags[f"perf/host_rss_gb/rank{rank}"])  # GiB
    # the slowest rank's busy time (without the collectives) over the mean of both, per iteration
    assert [s for s, _ in tags["perf/imbalance"]] == [512, 1024]
    for it, (_, imbalance) in enumerate(tags["perf/imbalance"]):
        b = [busy_s for _, i, busy_s in busy if i == it]
        assert abs(imbalance - max(b) / (sum(b) / 2)) < 1e-5, (imbalance, b)
    # Stopping after the first epoch is what it did: the same run with 1 epoch ends identical.
    out = run_trainer(
        *TINY,
        "--num-steps",
        "128",
        "--total-timesteps",
        "1024",
        "--run-name",
        "one",
        "--eval-episodes",
        "0",
        nproc=2,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = (torch.load(tmp_path / f"runs/{n}/ppo_atari_multigpu.model") for n in ("e2e", "one"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_single_process_run_needs_no_process_group_and_captures_video(run_trainer, tmp_path):
    out = run_trainer(
        *TINY,
        "--total-timesteps",
        "64",
        "--run-name",
        "single",
        "--capture-video",
        "--eval-episodes",
        "0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "single process" in out.stdout and "1 rank(s)" in out.stdout
    assert "charts/SPS" in scalar_tags(tmp_path / "runs" / "single")
    videos = list((tmp_path / "videos" / "single").glob("*.mp4"))
    assert videos and videos[0].stat().st_size > 1000


def launch_two_nodes(tmp_path, flags_of_node):
    """Two torchrun agents on loopback (c10d rendezvous), one rank each, in their own folders."""
    port, procs = free_port(), []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        torchrun = (
            f"-m torch.distributed.run --nnodes=2 --node_rank={node} --rdzv-backend=c10d "
            f"--rdzv-endpoint=127.0.0.1:{port} --nproc_per_node=1"
        )
        cmd = [sys.executable, *torchrun.split(), str(SCRIPT), *TINY, *flags_of_node(node)]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path / f"node{node}",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env-id", "BreakoutNoFrameskip-v5"], "unknown env id 'BreakoutNoFrameskip-v5'"),
        (["--backend", "nccl"], "--backend nccl needs CUDA"),
    ],
)
def test_bad_input_fails_fast_on_every_rank(run_trainer, flags, message):
    start = time.time()
    out = run_trainer(*TINY, *flags, "--pg-timeout", PG_TIMEOUT, nproc=2, timeout=PG_TIMEOUT)
    assert out.returncode != 0
    assert time.time() - start < PG_TIMEOUT / 2  # no rank waited for a peer that had stopped
    for rank in (0, 1):
        assert f"error [rank {rank}]: {message}" in out.stderr


def test_ranks_launched_with_different_flags_all_refuse_naming_flags_and_ranks(tmp_path):
    # two agents on loopback, c10d as in the README's two-node launch: each rank can refuse (and
    # name the other) only once the group formed from their global RANKs (LOCAL_RANK is 0 on both)
    flags = f"--total-timesteps 128 --pg-timeout {PG_TIMEOUT} --update-epochs".split()
    procs = launch_two_nodes(tmp_path, lambda node: [*flags, str(node + 1)])
    start = time.time()
    outs = [p.communicate(timeout=PG_TIMEOUT) for p in procs]
    # every rank refused at once: none ran into a collective the other never joins
    assert time.time() - start < PG_TIMEOUT / 2 and all(p.returncode != 0 for p in procs)
    for rank, (_, stderr) in enumerate(outs):
        assert f"error [rank {rank}]: ranks were launched with different flags: " in stderr
        assert "--update-epochs (rank 0: 1, rank 1: 2)" in stderr
        assert "exitcode  : 2 " in stderr  # fail()'s own code, not SIGABRT at interpreter exit


def test_uneven_ranks_train_together_on_their_own_env_counts(run_trainer, tmp_path):
    # --rank-envs 3 1: the ranks differ in local sizes (not refused as different flags), every
    # iteration counts the 4 envs of both, and the replicas take the same steps
    at = TINY.index("--local-num-envs")
    flags = TINY[:at] + TINY[at + 2 :]
    out = run_trainer(*flags, "--rank-envs", 3, 1, "--total-timesteps", 256, "--run-name", "un",
                      "--eval-episodes", 0, nproc=2)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank_envs [3, 1]" in out.stdout and "replicas identical: True" in out.stdout
    assert "iter 2/2 | step 256 |" in out.stdout  # (3 + 1) envs x 32 steps an iteration
