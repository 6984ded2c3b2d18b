"""Checkpoints, resume, restarts after a killed rank, timeouts, determinism and evaluation."""

import glob
import os
import random
import signal
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import SCRIPT, TINY, scalar_tags

import ppo_atari_multigpu as ppo


def small_checkpoint(iteration, num_actions=4):
    agent = ppo.Agent(num_actions)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    return {
        "model": agent.state_dict(),
        "optimizer": opt.state_dict(),
        "iteration": iteration,
        "global_step": 64 * iteration,
        "args": {"env_id": "X"},
        "rng": [ppo.rng_state()],
        "world_size": 1,
        "elapsed": 1.0,
    }


def test_crash_between_write_and_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    good = ppo.save_checkpoint(small_checkpoint(1), str(tmp_path), keep=3)

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        ppo.save_checkpoint(small_checkpoint(2), str(tmp_path), keep=3)
    assert os.path.exists(tmp_path / "ckpt_00000002.pt.tmp")  # the half-done write is there...
    assert ppo.latest_checkpoint(str(tmp_path)) == good  # ...but resume never picks it
    assert ppo.load_checkpoint(good, 4)["iteration"] == 1


def test_only_the_latest_keep_checkpoints_are_kept(tmp_path):
    for it in range(1, 6):
        ppo.save_checkpoint(small_checkpoint(it), str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt_00000004.pt", "ckpt_00000005.pt"]


def test_loaded_checkpoint_equals_saved_state_exactly(tmp_path):
    torch.manual_seed(3)
    agent = ppo.Agent(4)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    agent.get_value(torch.rand(2, 4, 84, 84) * 255).sum().backward()
    opt.step()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    saved = {
        "model": agent.state_dict(),
        "optimizer": opt.state_dict(),
        "iteration": 7,
        "global_step": 7168,
        "args": {},
        "rng": [ppo.rng_state()],
        "world_size": 1,
        "elapsed": 12.5,
    }
    draws = (random.random(), np.random.rand(), torch.rand(1))
    path = ppo.save_checkpoint(saved, str(tmp_path), keep=1)

    loaded = ppo.load_checkpoint(path, 4)
    for k, v in saved["model"].items():
        assert torch.equal(v, loaded["model"][k]), k
    restored = ppo.Agent(4)
    opt2 = torch.optim.Adam(restored.parameters(), lr=1e-3, eps=1e-5)
    opt2.load_state_dict(loaded["optimizer"])
    for k, st in opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[name], opt2.state_dict()["state"][k][name])
    assert (loaded["iteration"], loaded["global_step"], loaded["elapsed"]) == (7, 7168, 12.5)
    ppo.set_rng_state(loaded["rng"][0])  # the RNG streams continue exactly where they were saved
    assert draws == (random.random(), np.random.rand(), torch.rand(1))


@pytest.mark.parametrize(
    "case, words",
    [
        ("truncated", ["unreadable", "truncated or corrupt"]),
        ("garbage", ["unreadable"]),
        ("missing", ["does not exist"]),
        ("other_env", ["trained with 6 actions", "this env has 4"]),
        ("other_network", ["does not fit the network", "network.0.weight"]),
    ],
)
def test_bad_checkpoint_is_refused_with_one_line_naming_file_and_mismatch(tmp_path, case, words):
    path = str(tmp_path / "ckpt.pt")
    if case == "truncated":
        full = ppo.save_checkpoint(small_checkpoint(1), str(tmp_path), keep=1)
        data = open(full, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif case == "garbage":
        open(path, "wb").write(b"not a checkpoint at all" * 10)
    elif case == "other_env":
        torch.save(small_checkpoint(1, num_actions=6), path)
    elif case == "other_network":
        ckpt = small_checkpoint(1)
        ckpt["model"]["network.0.weight"] = torch.zeros(16, 4, 8, 8)
        torch.save(ckpt, path)
    with pytest.raises(ValueError) as err:
        ppo.load_checkpoint(path, 4)
    msg = str(err.value)
    assert "\n" not in msg and path in msg
    for word in words:
        assert word in msg


def test_corrupt_checkpoint_stops_every_rank_with_the_message(run_trainer, tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"\x80\x02garbage")
    out = run_trainer(*TINY, "--total-timesteps", "256", "--resume", "bad.pt", nproc=2, timeout=120)
    assert out.returncode != 0
    for rank in (0, 1):
        assert f"error [rank {rank}]: checkpoint bad.pt is unreadable" in out.stderr


def test_resume_continues_iteration_lr_schedule_and_stops_at_requested_total(run_trainer, tmp_path):
    common = [
        *TINY,
        "--total-timesteps",
        "256",
        "--save-interval",
        "1",
        "--keep-checkpoints",
        "10",
        "--eval-episodes",
        "0",
        "--run-name",
        "r",
    ]
    assert run_trainer(*common).returncode == 0
    uninterrupted_lr = scalar_tags(tmp_path / "runs/r")["charts/learning_rate"]
    for late in ("ckpt_00000003.pt", "ckpt_00000004.pt"):  # as if it crashed during iteration 3
        os.remove(tmp_path / "runs/r/checkpoints" / late)
    out = run_trainer(*common, "--resume", "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed runs/r/checkpoints/ckpt_00000002.pt: iteration 3, global step 128" in out.stdout
    assert "iter 3/4" in out.stdout and "iter 1/4" not in out.stdout
    final = ppo.load_checkpoint(str(tmp_path / "runs/r/checkpoints/ckpt_00000004.pt"), 4)
    assert (final["iteration"], final["global_step"]) == (4, 256)
    tags = scalar_tags(tmp_path / "runs/r")  # TensorBoard's view: no step twice, none missing
    assert tags["charts/learning_rate"] == uninterrupted_lr
    assert [s for s, _ in tags["charts/SPS"]] == [64, 128, 192, 256]


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(run_trainer, tmp_path):
    common = [*TINY, "--save-interval", "1", "--eval-episodes", "0", "--run-name", "nan"]
    assert run_trainer(*common, "--total-timesteps", "128").returncode == 0
    ckpt_dir = tmp_path / "runs/nan/checkpoints"
    before = {p: open(p, "rb").read() for p in glob.glob(str(ckpt_dir / "*"))}
    out = run_trainer(
        *common, "--total-timesteps", "256", "--resume", "auto", "--learning-rate", "1e38"
    )
    assert out.returncode != 0
    assert "non-finite" in out.stderr and "iteration 3" in out.stderr
    assert {p: open(p, "rb").read() for p in glob.glob(str(ckpt_dir / "*"))} == before


def test_two_identical_deterministic_cpu_runs_give_bit_identical_parameters(run_trainer, tmp_path):
    for name in ("d1", "d2"):
        out = run_trainer(
            *TINY,
            "--total-timesteps",
            "512",
            "--torch-deterministic",
            "--eval-episodes",
            "0",
            "--run-name",
            name,
            nproc=2,
        )
        assert out.returncode == 0, out.stderr[-2000:]
    a, b = (torch.load(tmp_path / f"runs/{n}/ppo_atari_multigpu.model") for n in ("d1", "d2"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_mode_plays_the_requested_number_of_games(run_trainer, tmp_path):
    torch.save(ppo.Agent(4).state_dict(), tmp_path / "m.model")
    out = run_trainer("--no-cuda", "--eval-checkpoint", "m.model", "--eval-episodes", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("eval m.model")][0]
    assert "3 episodes" in line and np.isfinite(float(line.split("return ")[1].split()[0]))


def test_evaluation_plays_full_games_and_takes_the_same_number_from_every_env(monkeypatch):
    # Record, inside each eval env, every episode end: its lives left and its real return.
    ends = {}

    class Recorder(gym.Wrapper):
        def __init__(self, env, idx):
            super().__init__(env)
            self.ends = ends.setdefault(idx, [])

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                ret = float(info["episode"]["r"]) if "episode" in info else None
                self.ends.append((info["lives"], ret))
            return obs, reward, terminated, truncated, info

    make_env = ppo.make_env

    def recording_make_env(env_id, idx, *rest, **kw):
        return lambda: Recorder(make_env(env_id, idx, *rest, **kw)(), idx)

    monkeypatch.setattr(ppo, "make_env", recording_make_env)
    torch.manual_seed(0)
    returns = ppo.evaluate(
        ppo.Agent(4),
        "BreakoutNoFrameskip-v4",
        3,
        torch.device("cpu"),
        False,
        "t",
        seed=1,
        max_envs=2,
    )
    # full games: an episode ends at game over only, never at a lost life
    assert sorted(ends) == [0, 1] and all(lives == 0 for e in ends.values() for lives, _ in e)
    # 3 games from 2 envs: each env's first game, then env 0's second (not whichever ends first)
    assert returns == [ends[0][0][1], ends[1][0][1], ends[0][1][1]]


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_run_trains_checkpoints_and_resumes(run_trainer, tmp_path, amp):
    common = [
        *TINY,
        "--total-timesteps",
        "192",
        "--save-interval",
        "1",
        "--eval-episodes",
        "0",
        "--amp",
        amp,
        "--run-name",
        amp,
    ]
    assert run_trainer(*common).returncode == 0
    ckpt_dir = tmp_path / f"runs/{amp}/checkpoints"
    os.remove(ckpt_dir / "ckpt_00000003.pt")
    out = run_trainer(*common, "--resume", "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "iteration 3, global step 128" in out.stdout and "iter 3/3" in out.stdout
    final = torch.load(ckpt_dir / "ckpt_00000003.pt", weights_only=True)
    assert final["global_step"] == 192 and final["args"]["amp"] == amp
    assert all(torch.isfinite(v).all() for v in final["model"].values())
    # fp16's loss scale travels with the checkpoint, so a resume does not restart it
    assert ("scale" in final["scaler"]) == (amp == "fp16")


def workers(launcher_pid):
    """PIDs of torchrun's worker processes, by the RANK in their environment."""
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


def launch(tmp_path, torchrun_flags, *flags):
    log = open(tmp_path / "stderr.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        *torchrun_flags,
        str(SCRIPT),
        *TINY,
        *flags,
    ]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=log, text=True)


def wait_for(cond, timeout, what, proc=None):
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, f"timed out waiting for {what}"
        assert proc is None or proc.poll() is None, f"the launcher exited while waiting for {what}"
        time.sleep(0.1)


def test_killed_rank_is_restarted_by_torchrun_and_the_run_resumes_to_the_requested_total(tmp_path):
    proc = launch(
        tmp_path,
        ["--max-restarts=1"],
        "--total-timesteps",
        "2048",
        "--save-interval",
        "1",
        "--resume",
        "auto",
        "--eval-episodes",
        "0",
    )
    try:
        wait_for(
            lambda: glob.glob(str(tmp_path / "runs/*/checkpoints/ckpt_*.pt")),
            120,
            "a first checkpoint",
            proc,
        )
        os.kill(workers(proc.pid)[1], signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, [
        x for x in (tmp_path / "stderr.log").read_text().splitlines() if "error" in x
    ]
    assert "resumed" in stdout and "iter 16/16" in stdout
    run_dirs = glob.glob(str(tmp_path / "runs/*"))
    assert len(run_dirs) == 1  # the restart found its own run, not a new one
    final = ppo.load_checkpoint(ppo.latest_checkpoint(run_dirs[0] + "/checkpoints"), 4)
    assert (final["iteration"], final["global_step"]) == (16, 2048)
    steps = [s for s, _ in scalar_tags(run_dirs[0])["charts/SPS"]]
    assert steps == list(range(128, 2049, 128))  # every iteration once, none lost, none twice


def test_a_hung_rank_makes_its_peer_fail_within_the_timeout(tmp_path):
    proc = launch(
        tmp_path, [], "--total-timesteps", "1000000", "--pg-timeout", "10", "--save-interval", "0"
    )
    hung = None
    try:
        wait_for(
            lambda: glob.glob(str(tmp_path / "runs/*/events*")), 120, "training to start", proc
        )
        time.sleep(3)  # both ranks are in the training loop now
        hung = workers(proc.pid)[1]
        os.kill(hung, signal.SIGSTOP)
        stopped = time.time()
        wait_for(
            lambda: "stopped responding" in (tmp_path / "stderr.log").read_text(),
            90,
            "rank 0's error",
        )
        assert time.time() - stopped < 10 + 30
    finally:
        if hung:
            os.kill(hung, signal.SIGCONT)
        proc.kill()
        proc.wait()
    assert "error [rank 0]" in (tmp_path / "stderr.log").read_text()
