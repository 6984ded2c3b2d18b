"""Checkpoints, resume, restarts after a killed rank, timeouts, determinism and evaluation."""

import contextlib
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
from conftest import SCRIPT, TINY, free_port, scalar_tags, torchrun, worker_pids

import ppo_atari_multigpu as ppo


def agent(num_actions=4):
    """The trainer's network for Breakout's frames (what load_checkpoint checks a file against)."""
    return ppo.Agent((4, 84, 84), num_actions)


def small_checkpoint(iteration, num_actions=4):
    agent_ = agent(num_actions)
    opt = torch.optim.Adam(agent_.parameters(), lr=1e-3)
    return {
        "model": agent_.state_dict(),
        "optimizer": opt.state_dict(),
        "iteration": iteration,
        "global_step": 64 * iteration,
        "args": {"env_id": "X"},
        "world_size": 1,
        "elapsed": 1.0,
    }


class Crash(BaseException):
    """The process dies here: no `except Exception` handler runs (as after a SIGKILL)."""


def test_crash_between_write_and_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    good = ppo.save_checkpoint(small_checkpoint(1), str(tmp_path), keep=3)

    def crash(src, dst):
        raise Crash("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(Crash):
        ppo.save_checkpoint(small_checkpoint(2), str(tmp_path), keep=3)
    assert os.path.exists(tmp_path / "ckpt_000000000128.pt.tmp")  # the half-done write is there...
    assert ppo.checkpoint_files(str(tmp_path))[-1] == good  # ...but resume never picks it
    assert ppo.load_checkpoint(good, agent())["iteration"] == 1


def test_a_failed_save_raises_oserror_and_leaves_no_temp_file(tmp_path, monkeypatch):
    good = ppo.save_checkpoint(small_checkpoint(1), str(tmp_path), keep=3)

    def full_disk(*args, **kwargs):  # torch's zip writer reports it as a RuntimeError
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0")

    monkeypatch.setattr(ppo.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        ppo.save_checkpoint(small_checkpoint(2), str(tmp_path), keep=3)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(good)]  # no partial file either


def test_only_the_latest_keep_checkpoints_are_kept(tmp_path):
    for it in range(1, 6):
        ppo.save_checkpoint(small_checkpoint(it), str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000000000256.pt", "ckpt_000000000320.pt"]


def trained_parts(seed=3):
    """An agent, its Adam after one step and an fp16 GradScaler that has scaled once."""
    torch.manual_seed(seed)
    agent_ = agent()
    opt = torch.optim.Adam(agent_.parameters(), lr=1e-3, eps=1e-5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(agent_.get_value(torch.rand(2, 4, 84, 84) * 255).sum()).backward()
    scaler.step(opt)
    scaler.update()
    return agent_, opt, scaler


def test_loaded_checkpoint_equals_saved_state_exactly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = resolved(save_interval=0)
    parts = trained_parts()
    real_time = ppo.time.time
    monkeypatch.setattr(ppo.time, "time", lambda: 1000.0)
    checkpointer = ppo.Checkpointer(args, "r", 0, 1)
    monkeypatch.setattr(ppo.time, "time", lambda: 1012.5)  # the run's training time so far
    path = checkpointer.maybe_save(3, 192, *parts, now=True)  # what the trainer writes
    monkeypatch.setattr(ppo.time, "time", real_time)

    loaded = ppo.load_checkpoint(path, agent())
    keys = {"model", "optimizer", "scaler", "iteration", "global_step", "args", "world_size"}
    assert set(loaded) == keys | {"elapsed", "unlogged"}  # no RNG states: a resume reseeds
    assert loaded["unlogged"] == []  # EventWriter's scalars waiting for a full disk: none
    model, optimizer, scaler = (part.state_dict() for part in parts)
    for k, v in model.items():
        assert torch.equal(v, loaded["model"][k]), k
    restored = agent()
    opt2 = torch.optim.Adam(restored.parameters(), lr=1e-3, eps=1e-5)
    opt2.load_state_dict(loaded["optimizer"])
    for k, st in optimizer["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[name], opt2.state_dict()["state"][k][name])
    assert "scale" in scaler and loaded["scaler"] == scaler  # fp16's loss scale and its tracker
    assert loaded["args"] == vars(args)
    assert (loaded["iteration"], loaded["global_step"], loaded["world_size"]) == (3, 192, 1)
    assert loaded["elapsed"] == 12.5


def test_a_resumed_run_draws_from_random_streams_the_fresh_start_did_not_use(tmp_path, monkeypatch):
    # RNG states are not saved: a resume reseeds python, numpy and torch from seed + rank + step,
    # so it is reproducible and does not repeat the draws of the run's fresh start
    monkeypatch.chdir(tmp_path)
    path = ppo.Checkpointer(resolved(), "r", 0, 1).maybe_save(2, 128, *trained_parts(), now=True)

    def draws():
        return random.random(), np.random.rand(), torch.rand(1).item()

    def resume():
        checkpointer = ppo.Checkpointer(resolved(resume=path), "r", 0, 1)
        assert checkpointer.resume(*trained_parts(seed=4)) == 128
        return draws()

    ppo.seed_everything(ppo.Args().seed + 0)  # what MAIN draws from at a fresh start (rank 0)
    fresh = draws()
    resumed = resume()
    assert all(a != b for a, b in zip(fresh, resumed))
    assert resume() == resumed  # the same checkpoint resumes the same streams


@pytest.mark.parametrize(
    "case, words",
    [
        ("truncated", ["unreadable", "truncated or corrupt"]),
        ("garbage", ["unreadable"]),
        ("missing", ["does not exist"]),
        ("other_env", ["trained with 6 actions", "this env has 4"]),
        ("other_network", ["does not fit the network: network.0.weight (16, 4, 8, 8) vs (32,"]),
        ("other_frame_stack", ["does not fit the network: network.0.weight (32, 2, 8, 8) vs"]),
        ("missing_key", ["does not fit the network: critic.bias missing vs (1,)"]),
        ("not_tensors", ["holds objects other than tensors: refused, nothing from it was run"]),
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
    elif case == "other_frame_stack":  # --frame-stack 2's network
        torch.save(ppo.Agent((2, 84, 84), 4).state_dict(), path)
    elif case == "missing_key":
        ckpt = small_checkpoint(1)
        del ckpt["model"]["critic.bias"]
        torch.save(ckpt, path)
    elif case == "not_tensors":  # unpickling it would create a file
        torch.save(dict(small_checkpoint(1), extra=Payload(str(tmp_path / "ran"))), path)
    with pytest.raises(ValueError) as err:
        ppo.load_checkpoint(path, agent())
    msg = str(err.value)
    assert "\n" not in msg and path in msg
    for word in words:
        assert word in msg
    assert not os.path.exists(tmp_path / "ran")  # nothing in the file ran


class Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_corrupt_checkpoint_stops_every_rank_with_the_message(run_trainer, tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"\x80\x02garbage")
    out = run_trainer(*TINY, "--total-timesteps", "256", "--resume", "bad.pt", nproc=2, timeout=120)
    assert out.returncode != 0
    for rank in (0, 1):
        assert f"error [rank {rank}]: checkpoint bad.pt is unreadable" in out.stderr


def test_resume_continues_iteration_lr_schedule_and_stops_at_requested_total_with_foreach_adam(
    run_trainer, tmp_path
):
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
    for late in (
        "ckpt_000000000192.pt",
        "ckpt_000000000256.pt",
    ):  # as if it crashed during iteration 3
        os.remove(tmp_path / "runs/r/checkpoints" / late)
    # ... and as if a trainer with fused Adam (d19c333..1130d19) had written the checkpoint
    path = tmp_path / "runs/r/checkpoints/ckpt_000000000128.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["optimizer"]["param_groups"][0].update(fused=True, foreach=None)
    del ckpt["digest"]  # (those trainers wrote none: an edited file keeping it is damaged)
    torch.save(ckpt, path)
    out = run_trainer(*common, "--resume", "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        "resumed runs/r/checkpoints/ckpt_000000000128.pt: iteration 3, global step 128"
        in out.stdout
    )
    assert "iter 3/4" in out.stdout and "iter 1/4" not in out.stdout
    final = ppo.load_checkpoint(str(tmp_path / "runs/r/checkpoints/ckpt_000000000256.pt"), agent())
    assert (final["iteration"], final["global_step"]) == (4, 256)
    # the resumed run steps with this trainer's Adam, the foreach one test_fast_path checks
    group = final["optimizer"]["param_groups"][0]
    assert group["foreach"] and not group["fused"]
    tags = scalar_tags(tmp_path / "runs/r")  # TensorBoard's view: no step twice, none missing
    assert tags["charts/learning_rate"] == uninterrupted_lr
    assert [s for s, _ in tags["charts/SPS"]] == [64, 128, 192, 256]


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(run_trainer, tmp_path):
    common = [
        *TINY,
        "--total-timesteps",
        "256",
        "--save-interval",
        "1",
        "--eval-episodes",
        "0",
        "--run-name",
        "nan",
    ]
    assert run_trainer(*common).returncode == 0
    ckpt_dir = tmp_path / "runs/nan/checkpoints"
    # the same run, resumed at step 128 with Adam moments that make the first step NaN
    ckpt = torch.load(ckpt_dir / "ckpt_000000000128.pt", weights_only=True)
    for state in ckpt["optimizer"]["state"].values():
        state["exp_avg"].fill_(float("nan"))
    del ckpt["digest"]  # a file without one loads as it is (with it, it is damaged)
    torch.save(ckpt, tmp_path / "poisoned.pt")
    before = {p: open(p, "rb").read() for p in glob.glob(str(ckpt_dir / "*"))}
    out = run_trainer(*common, "--resume", "poisoned.pt")
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
    torch.save(agent().state_dict(), tmp_path / "m.model")
    out = run_trainer("--no-cuda", "--eval-checkpoint", "m.model", "--eval-episodes", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("eval m.model")][0]
    assert "3 episodes" in line and np.isfinite(float(line.split("return ")[1].split()[0]))


def test_evaluation_plays_full_games_and_takes_the_same_number_from_every_env(monkeypatch):
    # Record, inside each eval env, every episode end: its lives left and, at a game's end, the
    # real return of the whole game.
    ends = {}

    class Recorder(gym.Wrapper):
        def __init__(self, env, idx):
            super().__init__(env)
            self.ends = ends.setdefault(idx, [])

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                game = float(info["episode"]["r"]) if "episode" in info else None
                self.ends.append((info["lives"], game))
            return obs, reward, terminated, truncated, info

    make_env = ppo.make_env

    def recording_make_env(env_id, idx, *rest):
        return lambda: Recorder(make_env(env_id, idx, *rest)(), idx)

    monkeypatch.setattr(ppo, "make_env", recording_make_env)
    torch.manual_seed(0)
    args = ppo.Args(env_id="BreakoutNoFrameskip-v4", eval_episodes=3, seed=1)
    returns = ppo.evaluate(agent(), args, torch.device("cpu"), "t", max_envs=2)
    games = {i: [r for lives, r in e if r is not None] for i, e in ends.items()}
    # a lost life ends a learning episode as in training, but a game counts only at game over
    assert all(r is None for e in ends.values() for lives, r in e if lives > 0)
    assert all(lives == 0 for e in ends.values() for lives, r in e if r is not None)
    assert sum(r is None for e in ends.values() for _, r in e) >= 8  # 4 lost lives per game
    # 3 games from 2 envs: each env's first game, then env 0's second (not whichever ends first)
    assert returns == [games[0][0], games[1][0], games[0][1]]


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_run_trains_checkpoints_and_resumes(run_trainer, tmp_path, amp):
    common = [
        *TINY,
        "--num-steps",  # 2 envs x 8 steps an iteration: fp16 convolutions are slow on a CPU
        "8",
        "--total-timesteps",
        "48",
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
    os.remove(ckpt_dir / "ckpt_000000000048.pt")
    out = run_trainer(*common, "--resume", "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "iteration 3, global step 32" in out.stdout and "iter 3/3" in out.stdout
    final = torch.load(ckpt_dir / "ckpt_000000000048.pt", weights_only=True)
    assert final["global_step"] == 48 and final["args"]["amp"] == amp
    assert all(torch.isfinite(v).all() for v in final["model"].values())
    # fp16's loss scale travels with the checkpoint, so a resume does not restart it
    assert ("scale" in final["scaler"]) == (amp == "fp16")


def launch(tmp_path, torchrun_flags, *flags):
    log = open(tmp_path / "stderr.log", "w")
    cmd = [*torchrun(2, *torchrun_flags), *TINY, *map(str, flags)]
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
        os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, [
        x for x in (tmp_path / "stderr.log").read_text().splitlines() if "error" in x
    ]
    assert "resumed" in stdout and "iter 16/16" in stdout
    run_dirs = glob.glob(str(tmp_path / "runs/*"))
    assert len(run_dirs) == 1  # the restart found its own run, not a new one
    newest = ppo.checkpoint_files(run_dirs[0] + "/checkpoints")[-1]
    final = ppo.load_checkpoint(newest, agent())
    assert (final["iteration"], final["global_step"]) == (16, 2048)
    steps = [s for s, _ in scalar_tags(run_dirs[0])["charts/SPS"]]
    assert steps == list(range(128, 2049, 128))  # every iteration once, none lost, none twice


# ---- cluster-proof resume ----
def test_checkpoints_are_named_and_pruned_by_global_step_across_a_larger_batch(tmp_path):
    # 1 rank saved iterations 150/200/250 (64 steps each); resumed with a 2x larger global batch,
    # iteration 137 is step 17,536: the newest checkpoint, so it is kept and `auto` picks it.
    for iteration in (150, 200, 250):
        ppo.save_checkpoint(small_checkpoint(iteration), str(tmp_path), keep=3)
    newest = dict(small_checkpoint(137), global_step=137 * 128)
    path = ppo.save_checkpoint(newest, str(tmp_path), keep=3)
    assert os.path.exists(path) and ppo.checkpoint_files(str(tmp_path))[-1] == path
    assert len(os.listdir(tmp_path)) == 3 and not os.path.exists(tmp_path / "ckpt_000000009600.pt")


def test_a_save_removes_stale_temp_files(tmp_path):
    (tmp_path / "ckpt_000000000064.pt.tmp").write_bytes(b"half written")
    ppo.save_checkpoint(small_checkpoint(2), str(tmp_path), keep=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt_000000000128.pt"]


def test_auto_run_name_is_a_function_of_the_configuration(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ppo.Args(resume="auto", num_envs=8)
    ppo.resolve_sizes(args, 2)
    same = ppo.Args(resume="auto", num_envs=8, threads=3, env_backend="native")
    ppo.resolve_sizes(same, 4)  # other world size, same global batch: the same run
    assert ppo.choose_run_name(args) == ppo.choose_run_name(same)
    for flags in (dict(learning_rate=1e-3), dict(frame_stack=2), dict(exp_name="other")):
        other = ppo.resolve_sizes(ppo.Args(resume="auto", num_envs=8, **flags), 2)
        assert ppo.choose_run_name(args) != ppo.choose_run_name(other), flags
    assert ppo.choose_run_name(args).startswith("BreakoutNoFrameskip-v4__ppo_atari_multigpu__1__")


def test_two_fresh_launches_in_the_same_second_get_separate_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ppo.time, "time", lambda: 1_800_000_000.5)
    names = {ppo.choose_run_name(ppo.Args()) for _ in range(3)}
    assert len(names) == 3 and all((tmp_path / "runs" / n).is_dir() for n in names)


def resolved(world_size=1, **flags):
    flags = {"total_timesteps": 256, "num_steps": 32, **flags}
    return ppo.resolve_sizes(ppo.Args(**flags), world_size)


def test_resume_with_other_algorithm_flags_is_refused_naming_old_and_new_values():
    ckpt = small_checkpoint(2)
    ckpt["args"] = vars(resolved(local_num_envs=2))
    assert ppo.resume_problem(ckpt, "c.pt", resolved(local_num_envs=2, threads=1)) is None
    # the same global batch on another world size, another backend and precision: allowed
    safe = resolved(2, num_envs=2, env_backend="native", amp="bf16", grad_accum=2)
    assert ppo.resume_problem(ckpt, "c.pt", safe) is None
    changed = resolved(local_num_envs=2, total_timesteps=512, anneal_lr=False)
    msg = ppo.resume_problem(ckpt, "c.pt", changed)
    assert "--total-timesteps" not in msg and "--anneal-lr True -> False" in msg  # may extend
    msg = ppo.resume_problem(ckpt, "c.pt", resolved(2, local_num_envs=2))
    assert "--num-envs 2 -> 4" in msg and "--num-envs keeps the global batch" in msg


def test_resume_from_a_bare_model_file_is_refused_with_a_clear_message(tmp_path):
    torch.save(agent().state_dict(), tmp_path / "m.model")
    ckpt = ppo.load_checkpoint(str(tmp_path / "m.model"), agent())
    msg = ppo.resume_problem(ckpt, "m.model", resolved())
    assert "holds only model weights" in msg and "--eval-checkpoint" in msg


def test_evaluation_presses_fire_after_a_lost_life_as_training_does(monkeypatch):
    # An agent that only ever chooses NOOP: Breakout stays frozen after a lost life unless the
    # pipeline presses FIRE, and the game would never end.
    steps = [0]

    class Limit(gym.Wrapper):
        def step(self, action):
            steps[0] += 1
            assert steps[0] < 20_000, "the game froze after a lost life"
            return self.env.step(action)

    make_env = ppo.make_env
    monkeypatch.setattr(ppo, "make_env", lambda *a: lambda: Limit(make_env(*a)()))
    noop = agent()
    with torch.no_grad():
        noop.actor.weight.zero_()
        noop.actor.bias.copy_(torch.tensor([50.0, 0.0, 0.0, 0.0]))  # NOOP with p ~ 1
    args = ppo.Args(env_id="BreakoutNoFrameskip-v4", eval_episodes=1, seed=1)
    returns = ppo.evaluate(noop, args, torch.device("cpu"), "t")
    assert len(returns) == 1


def test_resume_across_world_sizes_keeps_the_global_batch_and_logs_each_step_once(
    run_trainer, tmp_path
):
    common = [
        *TINY,
        "--num-envs",
        "4",
        "--total-timesteps",
        "768",
        "--save-interval",
        "1",
        "--keep-checkpoints",
        "10",
        "--eval-episodes",
        "0",
        "--resume",
        "auto",
    ]
    ckpts = tmp_path / "runs"

    def drop_after(step):  # as if the job died right after the checkpoint at `step`
        for path in ckpts.glob("*/checkpoints/ckpt_*.pt"):
            if int(path.name[5:-3]) > step:
                path.unlink()

    out = run_trainer(*common, "--local-num-envs", "4")
    assert out.returncode == 0, out.stderr[-2000:]
    drop_after(256)
    out = run_trainer(*common, "--local-num-envs", "2", nproc=2)  # 1 -> 2 ranks
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed" in out.stdout and "global step 256" in out.stdout
    drop_after(512)
    (name,) = [p.name for p in ckpts.iterdir()]
    # requeued on 1 rank without --num-envs: 2 envs in all, another auto name, no checkpoint;
    # it stops, naming the run and the flag that continues it (issue 41, item 8)
    at = common.index("--num-envs")
    fewer = common[:at] + common[at + 2 :]
    out = run_trainer(*fewer, "--local-num-envs", "2")
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error")]
    assert out.returncode != 0 and "iter " not in out.stdout, out.stderr[-2000:]
    assert f"run {name} " in line and "give --num-envs 4 to continue it" in line, line
    assert "or --num-envs 2 to start a new run" in line
    out = run_trainer(*common, "--local-num-envs", "4")  # 2 -> 1 rank
    assert out.returncode == 0, out.stderr[-2000:]
    assert "global step 512" in out.stdout
    run_dirs = list(ckpts.iterdir())
    assert {p.parent.parent.name for p in ckpts.glob("*/checkpoints/*")} == {name}
    steps = [s for s, _ in scalar_tags(run_dirs[0])["charts/SPS"]]
    assert steps == list(range(128, 769, 128))
    out = run_trainer(*common, "--local-num-envs", "4")  # the finished run does nothing more
    assert out.returncode == 0 and "is complete" in out.stdout and "iter " not in out.stdout
    # a --num-envs given on purpose is a choice: a new run starts (one iteration), no stop
    out = run_trainer(*fewer, "--num-envs", "2", "--total-timesteps", "64")
    assert out.returncode == 0 and "iter 1/1" in out.stdout, out.stderr[-2000:]


def pending_signals(pid):
    """Signals sent to pid and not delivered yet: a stopped process keeps them pending."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    mask = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return {sig for sig in signal.Signals if mask >> (sig - 1) & 1}


def test_a_node_joining_an_elastic_job_continues_the_run_at_the_new_world_size(tmp_path):
    # torchrun --nnodes=1:2 on loopback: the first agent trains alone; when the second joins,
    # torchrun stops the worker (SIGTERM: it saves), re-forms the group with 2 ranks, and the run
    # goes on from that checkpoint with the same global batch (--num-envs). torch 2.13 needs the
    # rendezvous TCPStore unshared for a scale-up (README "Long runs and failures").
    # No race with the first node finishing alone: its worker is paused (SIGSTOP) after its first
    # checkpoint until its agent, seeing the second node, has sent it the SIGTERM (pending in the
    # stopped process); then it goes on, handles it and saves.
    port = free_port()
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    torchrun = (
        f"-m torch.distributed.run --nnodes=1:2 --nproc_per_node=1 --rdzv-backend=c10d "
        f"--rdzv-endpoint=127.0.0.1:{port} --rdzv-id=elastic --rdzv-conf last_call_timeout=1 "
        "--max-restarts=3 --monitor-interval=0.5"
    )
    flags = (
        "--no-cuda --num-envs 2 --num-steps 16 --update-epochs 1 --num-minibatches 2 "
        "--total-timesteps 640 --save-interval 1 --resume auto --eval-episodes 0 --pg-timeout 60"
    )
    cmd = [sys.executable, *torchrun.split(), str(SCRIPT), *flags.split()]
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in (0, 1)]
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=logs[0], stderr=subprocess.STDOUT)
    second = paused = None
    try:
        ckpts = str(tmp_path / "runs/*/checkpoints/ckpt_*.pt")
        wait_for(lambda: glob.glob(ckpts), 120, "the first node's checkpoint", first)
        paused = worker_pids(first.pid)[0]
        os.kill(paused, signal.SIGSTOP)
        second = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=logs[1], stderr=subprocess.STDOUT
        )
        wait_for(
            lambda: signal.SIGTERM in pending_signals(paused),
            120,
            "the first agent to stop its worker for the joining node",
            first,
        )
        os.kill(paused, signal.SIGCONT)
        codes = [first.wait(timeout=300), second.wait(timeout=60)]
    finally:
        if paused is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(paused, signal.SIGCONT)
        for proc in (first, second):
            if proc is not None:
                proc.kill()
    out = "".join((tmp_path / f"agent{i}.log").read_text() for i in (0, 1))
    assert codes == [0, 0], out[-3000:]
    assert "1 rank(s)" in out and "2 rank(s)" in out and "resumed" in out
    run_dirs = glob.glob(str(tmp_path / "runs/*"))
    assert len(run_dirs) == 1
    saved = [torch.load(p, weights_only=True) for p in glob.glob(f"{run_dirs[0]}/checkpoints/*.pt")]
    assert max(saved, key=lambda c: c["global_step"])["world_size"] == 2  # the run went on with 2
    steps = [s for s, _ in scalar_tags(run_dirs[0])["charts/SPS"]]
    assert steps == list(range(32, 641, 32))  # exactly the requested steps, none twice
