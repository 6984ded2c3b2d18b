"""Issue 34: every common edit a researcher makes is ONE local change that works in every mode.
Each test makes the edit to a COPY of the trainer (exact source lines replaced, each found exactly
once) and runs it; issue 36's resume across --compile and CUDA thread counts close the file."""

import importlib.util
import inspect
import re
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from conftest import SCRIPT, TINY, assert_equal_to_rounding, scalar_tags, torchrun

import ppo_atari_multigpu as ppo

CPU = torch.device("cpu")
N_ACTIONS = 4


def tiny(ranks=1, num_steps=32):
    """Flags of a tiny run of exactly 2 iterations (TINY: 2 envs per rank, 2 minibatches), no
    evaluation. One process gets --threads 1 (a rank of a 2-rank run gets cores // 2): on a
    machine whose cores are busy with other work, more threads mostly wait for each other."""
    steps = [*TINY]
    steps[steps.index("--num-steps") + 1] = str(num_steps)
    total = 2 * ranks * 2 * num_steps
    one = ["--threads", "1"] if ranks == 1 else []
    return [*steps, *one, "--total-timesteps", str(total), "--eval-episodes", "0"]


DONE = re.compile(r"^done: \d+ steps in .*replicas identical: True$", re.M)


# ---- the edits ---------------------------------------------------------------------------------
def edited_copy(directory, edits, name=SCRIPT.name):
    """A copy of the trainer in `directory` with each (line, replacement) made: `line` is a whole
    line of the trainer and must occur exactly once."""
    lines = SCRIPT.read_text().splitlines(keepends=True)
    for line, new in edits:
        where = [i for i, x in enumerate(lines) if x.rstrip("\n") == line]
        assert len(where) == 1, f"{line!r} occurs {len(where)} times in the trainer"
        lines[where[0]] = new if new.endswith("\n") else new + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("".join(lines))
    return path


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finished(out, world_size):
    """The run ended well: exit 0 and the final `done:` line (ranks agreeing where several)."""
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert DONE.search(out.stdout), out.stdout[-2000:]
    assert f": {world_size} rank(s)" in out.stdout, out.stdout[:500]


# ---- 1. a new encoder: IMPALA's ResNet (CleanRL's procgen script) -----------------------------
class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x):
        inputs = x
        x = nn.functional.relu(x)
        x = self.conv0(x)
        x = nn.functional.relu(x)
        x = self.conv1(x)
        return x + inputs


class ConvSequence(nn.Module):
    def __init__(self, input_shape, out_channels):
        super().__init__()
        self.input_shape, self.out_channels = input_shape, out_channels
        self.conv = nn.Conv2d(input_shape[0], out_channels, kernel_size=3, padding=1)
        self.max_pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.res_block0 = ResidualBlock(out_channels)
        self.res_block1 = ResidualBlock(out_channels)

    def forward(self, x):
        x = self.max_pool(self.conv(x))
        return self.res_block1(self.res_block0(x))

    def get_output_shape(self):
        _, h, w = self.input_shape
        return (self.out_channels, (h + 1) // 2, (w + 1) // 2)


def impala_cnn(obs_shape):
    """IMPALA's encoder: frames (C, H, W) scaled to [0, 1] in, 256 features out."""
    shape, layers = tuple(obs_shape), []
    for out_channels in (16, 32, 32):
        layers.append(ConvSequence(shape, out_channels))
        shape = layers[-1].get_output_shape()
    fc = nn.Linear(shape[0] * shape[1] * shape[2], 256)
    return nn.Sequential(*layers, nn.Flatten(), nn.ReLU(), fc, nn.ReLU())


IMPALA_SOURCE = "\n\n".join(inspect.getsource(x) for x in (ResidualBlock, ConvSequence, impala_cnn))
IMPALA_EDIT = [
    ("class Agent(nn.Module):", IMPALA_SOURCE + "\n\nclass Agent(nn.Module):"),
    (
        "        self.network = nature_cnn(obs_shape)",
        "        self.network = impala_cnn(obs_shape)",
    ),
]


@pytest.fixture(scope="module")
def impala_copy(tmp_path_factory):
    return edited_copy(tmp_path_factory.mktemp("impala"), IMPALA_EDIT)


def frames_and_batch(n, seed=0):
    """A rollout-like batch: uint8 frames stored as the trainer stores them (channels-last
    storage of (n // 2 steps, 2 envs)), actions, old log-probs, advantages, returns, values, by
    name as MAIN's `batch`."""
    g = torch.Generator().manual_seed(seed)
    frames = ppo.frame_buffer((n // 2, 2, 4, 84, 84), True, CPU).reshape(-1, 4, 84, 84)
    frames.copy_(torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8))
    return dict(
        obs=frames,
        actions=torch.randint(0, N_ACTIONS, (n,), generator=g),
        logprobs=-1.4 + 0.1 * torch.randn(n, generator=g),
        advantages=torch.randn(n, generator=g),
        returns=torch.randn(n, generator=g),
        values=torch.randn(n, generator=g),
    )


def test_impala_encoder_edit_is_one_function_and_one_line(impala_copy):
    text = impala_copy.read_text()
    assert text.count("def impala_cnn(obs_shape):") == 1
    assert "self.network = impala_cnn(obs_shape)" in text
    assert "self.network = nature_cnn(obs_shape)" not in text
    module = load_module(impala_copy, "ppo_impala")
    agent = module.Agent((4, 84, 84), N_ACTIONS)
    assert isinstance(agent.network[0], module.ConvSequence)
    assert agent.actor.in_features == agent.critic.in_features == 256  # sized from the data
    frames = frames_and_batch(4)["obs"]
    with torch.no_grad():
        out = agent.get_action_and_value(frames)
    assert out["action"].shape == out["logprob"].shape == out["entropy"].shape == (4,)
    assert out["value"].shape == (4, 1)


def test_impala_trains_with_two_ranks_grad_accum_and_the_native_backend(run_trainer, impala_copy):
    out = run_trainer(
        *tiny(ranks=2, num_steps=16),
        "--grad-accum",
        "2",
        "--env-backend",
        "native",
        launcher=torchrun(2, script=impala_copy),
        timeout=300,
    )
    finished(out, 2)
    assert "iter 2/2" in out.stdout


def test_impala_compiled_policy_equals_eager_and_its_loss_sends_fc_gradient_before_conv_backward(
    monkeypatch,
):
    # --compile on IMPALA, both graphs (a 2-rank compiled run of the default network is
    # test_fast_path's). As test_fast_path.py checks for the default network: with `overlap`
    # (several ranks) the graph break at nn.Flatten lets the post-Flatten layer's gradient (and
    # so its bucket) out while the first convolution's backward has not run yet. Without the
    # break (overlap=False) conv1's gradient is already there at fc's hook (measured: [True, True]).
    monkeypatch.setattr(ppo, "nature_cnn", impala_cnn)
    torch._dynamo.reset()  # dynamo does not guard on module hooks: no graph of another agent
    torch.manual_seed(0)
    args = ppo.Args(compile=True)
    agent = ppo.speed_up(ppo.Agent((4, 84, 84), N_ACTIONS), args, overlap=True)
    first_conv, fc = agent.network[0].conv.weight, agent.network[5].weight
    assert isinstance(agent.network[4], nn.ReLU) and isinstance(agent.network[3], nn.Flatten)
    params = list(agent.parameters())
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    buckets = ppo.GradBuckets(params, flat, args.bucket_mb, 1)
    conv_done = []  # at each fc gradient: is the first conv's already in the buffer?
    fc.register_post_accumulate_grad_hook(lambda _: conv_done.append(bool(first_conv.grad.any())))
    batch, inds = frames_and_batch(64), torch.arange(32)
    autocast, scaler = ppo.precision(args, CPU)
    coef = ppo.loss_coefficients(args, CPU)
    ppo.minibatch_gradient(agent, args, coef, batch, inds, buckets, autocast, scaler)
    with torch.compiler.set_stance("fail_on_recompile"):  # the break costs no recompilation
        ppo.minibatch_gradient(agent, args, coef, batch, inds + 32, buckets, autocast, scaler)
    assert conv_done == [False, False]
    assert first_conv.grad.abs().sum() > 0  # ... and it did arrive, after
    with torch.no_grad():  # the rollout's compiled step: what eager gives for its actions
        out = agent.compiled_policy(batch["obs"][:2])
        eager = agent.get_action_and_value(batch["obs"][:2], out["action"])
    for key in ("logprob", "entropy", "value"):
        assert_equal_to_rounding(out[key], eager[key])


@pytest.mark.parametrize("flags", [["--amp", "bf16", "--async-envs"], ["--amp", "fp16"]])
def test_impala_trains_under_mixed_precision_and_async_envs(run_trainer, impala_copy, flags):
    out = run_trainer(
        *tiny(num_steps=4),  # fp16 convolutions are slow on a CPU: 8 samples an iteration
        *flags,
        launcher=[sys.executable, str(impala_copy)],
        timeout=300,
    )
    finished(out, 1)


# ---- the 2-rank gradients of the edited networks (gloo, spawned in-process) --------------------
LOCAL = 16  # samples per rank per minibatch


class LaunchCount(ppo.GradBuckets):
    """Records how many buckets backward itself had launched when wait() came."""

    def wait(self):
        self.launched_in_backward = len(self.works)
        super().wait()


def flat_gradient(module, batch, world_size):
    """`module`'s flat buffer after one minibatch on this rank's `batch` (all-reduced over
    world_size ranks): the gradient, the LOSS_STATS, how many buckets left during backward."""
    torch.manual_seed(0)  # the same replica on every rank
    args = module.Args()
    agent = module.speed_up(module.Agent((4, 84, 84), N_ACTIONS), args, overlap=world_size > 1)
    args.world_size, args.minibatch_size = world_size, len(batch["obs"]) * world_size
    params = list(agent.parameters())
    flat = module.flat_grad_buffer(params, len(module.LOSS_STATS))
    buckets = LaunchCount(params, flat, args.bucket_mb, world_size)
    autocast, scaler = module.precision(args, CPU)
    coef = module.loss_coefficients(args, CPU)
    inds = torch.arange(len(batch["obs"]))
    module.minibatch_gradient(agent, args, coef, batch, inds, buckets, autocast, scaler)
    buckets.wait()
    n = flat.numel() - len(module.LOSS_STATS)
    return flat[:n].clone(), flat[n:].clone(), buckets.launched_in_backward


def two_rank_worker(rank, world_size, store, value_mean_copy, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    union = frames_and_batch(LOCAL * world_size, seed=123)
    mine = {k: x[rank * LOCAL : (rank + 1) * LOCAL] for k, x in union.items()}
    out = {}
    ppo.nature_cnn = impala_cnn  # the encoder edit (this process only)
    out["impala"] = flat_gradient(ppo, mine, world_size)
    out["impala_union"] = flat_gradient(ppo, union, 1)
    edited = load_module(value_mean_copy, "ppo_value_mean")  # the LOSS_STATS edit (nature_cnn)
    out["value_mean"] = flat_gradient(edited, mine, world_size)
    out["value_mean_local"] = flat_gradient(edited, mine, 1)
    out["stats"] = edited.LOSS_STATS
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


_two_ranks = {}


def two_ranks(tmp_path_factory, value_mean_copy):
    if "r" not in _two_ranks:  # one spawn serves both tests
        d = tmp_path_factory.mktemp("two-ranks")
        mp.spawn(
            two_rank_worker, args=(2, str(d / "store"), str(value_mean_copy), str(d)), nprocs=2
        )
        _two_ranks["r"] = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return _two_ranks["r"]


def test_impala_two_rank_gradient_equals_the_single_process_gradient_on_the_union(
    tmp_path_factory, value_mean_copy
):
    r0, r1 = two_ranks(tmp_path_factory, value_mean_copy)
    grad, stats, launched = r0["impala"]
    union_grad, union_stats, _ = r0["impala_union"]
    assert grad.abs().sum() > 0
    assert_equal_to_rounding(grad, union_grad)
    assert_equal_to_rounding(stats, union_stats)
    assert torch.equal(grad, r1["impala"][0])  # every rank holds the very same average
    assert launched >= 1 and r1["impala"][2] >= 1  # buckets left during the residual backward


# ---- 2. --frame-stack 2 -------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sync", "native"])
def test_frame_stack_2_trains_in_both_env_backends(run_trainer, backend):
    # exit 0 means the env gave (2, 84, 84) frames: RankEnvs refuses any other shape at start
    out = run_trainer(
        *tiny(),
        "--frame-stack",
        "2",
        "--env-backend",
        backend,
    )
    finished(out, 1)


def games(infos):
    fi = infos.get("final_info", {})
    return [] if "episode" not in fi else list(np.flatnonzero(fi["_episode"]))


def test_native_two_frame_stack_shifts_and_keeps_the_final_frame_at_a_game_over():
    env_id = "BreakoutShortStackNoFrameskip-v4"  # games cut after 400 raw frames (~100 steps)
    if env_id not in gym.registry:
        kwargs = {**gym.spec("BreakoutNoFrameskip-v4").kwargs, "max_num_frames_per_episode": 400}
        gym.register(env_id, entry_point="ale_py.env:AtariEnv", kwargs=kwargs)
    n = 2
    env = ppo.NativeVectorEnv(env_id, n, 1, frame_stack=2)
    raw = []  # the single frames ale-py returns: the game's final frame is in its final_obs
    recv = env.env.recv
    env.env.recv = lambda: (out := recv(), raw.append(out[4].get("final_obs")))[0]
    obs, _ = env.reset(seed=[7, 8])
    assert env.single_observation_space.shape == (2, 84, 84)
    assert obs.shape == (n, 2, 84, 84) and obs.dtype == np.uint8
    rng, ended = np.random.default_rng(0), []
    for _ in range(300):
        prev = obs
        obs, _, term, trunc, infos = env.step(rng.integers(0, N_ACTIONS, n))
        assert obs.shape == (n, 2, 84, 84)
        going = ~(term | trunc)
        assert (obs[going, 0] == prev[going, 1]).all()  # the stack shifts by one frame
        ended = games(infos)
        if ended:
            break
    assert ended, "no game ended"
    final = infos["final_obs"]
    assert final.shape == (n, 2, 84, 84)
    for i in ended:
        assert (final[i, 0] == prev[i, 1]).all()  # the old game's last stack, shifted ...
        assert (final[i, 1] == raw[-1][i, 0]).all()  # ... ending with its final frame,
        assert not (final[i, 1] == obs[i, 0]).all()  # not the new game's first frame
        assert (obs[i] == obs[i, :1]).all()  # which starts the new stack, twice
    env.close()


# ---- 3. a new hyperparameter joins the run's identity ------------------------------------------
MY_COEF_EDIT = [
    (
        '    """coefficient of the value function"""',
        '    """coefficient of the value function"""\n'
        '    my_coef: float = 1.0\n    """a new coefficient"""\n',
    )
]


@pytest.fixture(scope="module")
def my_coef_copy(tmp_path_factory):
    lines = SCRIPT.read_text().splitlines()
    assert lines[lines.index("    vf_coef: float = 0.5") + 1] == MY_COEF_EDIT[0][0]  # its docstring
    return edited_copy(tmp_path_factory.mktemp("my-coef"), MY_COEF_EDIT)


def test_a_new_args_field_names_another_auto_run_and_a_resume_refuses_a_change(my_coef_copy):
    module = load_module(my_coef_copy, "ppo_my_coef")
    assert "my_coef" not in module.RESUMABLE  # nothing else was edited

    def resolved(**kw):
        return module.resolve_sizes(module.Args(resume="auto", total_timesteps=2048, **kw), 1)

    name = module.choose_run_name
    assert name(resolved(my_coef=1.0)) == name(resolved(my_coef=1.0))
    assert name(resolved(my_coef=1.0)) != name(resolved(my_coef=2.0))
    saved = {"optimizer": {}, "args": vars(resolved(my_coef=1.0))}
    msg = module.resume_problem(saved, "c.pt", resolved(my_coef=2.0))
    assert msg is not None and "--my-coef 1.0 -> 2.0" in msg
    # a RESUMABLE field may change
    assert module.resume_problem(saved, "c.pt", resolved(my_coef=1.0)) is None
    assert module.resume_problem(saved, "c.pt", resolved(threads=3, env_backend="native")) is None


def test_a_sweep_over_a_new_flag_with_resume_auto_trains_each_value_in_its_own_run(
    run_trainer, tmp_path, my_coef_copy
):
    common = tiny()
    launcher = [sys.executable, str(my_coef_copy)]
    first = run_trainer(*common, "--resume", "auto", launcher=launcher, timeout=300)
    finished(first, 1)
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "checkpoints/ckpt_000000000128.pt").exists()  # complete
    second = run_trainer(
        *common, "--resume", "auto", "--my-coef", "2.0", launcher=launcher, timeout=300
    )
    finished(second, 1)
    assert "nothing to do" not in second.stdout and "iter 1/2" in second.stdout
    names = [re.search(r"^run (\S+):", out.stdout, re.M).group(1) for out in (first, second)]
    assert names[0] != names[1]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(names)


# ---- 4. a loss statistic with its TensorBoard tag ----------------------------------------------
LOSS_STATS_LINE = (
    'LOSS_STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", '
    '"clipfrac")'
)
STATS_LINE = "    stats.update(policy_loss=pg_loss, value_loss=v_loss, entropy=entropy_loss)"
VALUE_MEAN_EDIT = [
    (LOSS_STATS_LINE, LOSS_STATS_LINE[:-1] + ', "value_mean")'),
    (STATS_LINE, STATS_LINE + '\n    stats["value_mean"] = newvalue.mean().detach()'),
]


@pytest.fixture(scope="module")
def value_mean_copy(tmp_path_factory):
    return edited_copy(tmp_path_factory.mktemp("value-mean"), VALUE_MEAN_EDIT)


def test_a_new_loss_statistic_is_logged_once_per_iteration_from_two_ranks(
    run_trainer, tmp_path, value_mean_copy
):
    out = run_trainer(
        *tiny(ranks=2),
        "--run-name",
        "v",
        launcher=torchrun(2, script=value_mean_copy),
        timeout=300,
    )
    finished(out, 2)
    tags = scalar_tags(tmp_path / "runs/v")
    logged = tags["losses/value_mean"]
    assert [step for step, _ in logged] == [128, 256]  # 2 ranks x 2 envs x 32 steps each
    assert all(np.isfinite(v) for _, v in logged)


def test_a_new_loss_statistic_is_the_mean_over_ranks(tmp_path_factory, value_mean_copy):
    r0, r1 = two_ranks(tmp_path_factory, value_mean_copy)
    k = r0["stats"].index("value_mean")
    assert r0["stats"][-1] == "value_mean" and len(r0["stats"]) == len(ppo.LOSS_STATS) + 1
    local = [r["value_mean_local"][1][k] for r in (r0, r1)]
    assert local[0] != local[1]  # the ranks' own samples give other values
    for r in (r0, r1):
        assert_equal_to_rounding(r["value_mean"][1][k], (local[0] + local[1]) / 2)
    assert torch.equal(r0["value_mean"][1], r1["value_mean"][1])  # every rank reads the same


# ---- 5. a schedule of a loss coefficient -------------------------------------------------------
def test_changing_a_coefficient_in_place_changes_the_eager_loss():
    torch.manual_seed(0)
    agent = ppo.speed_up(ppo.Agent((4, 84, 84), N_ACTIONS), ppo.Args())
    args = ppo.Args()
    coef = ppo.loss_coefficients(args, CPU)
    assert all(c.dim() == 0 for c in coef.values())
    batch = frames_and_batch(8)
    loss0, stats = ppo.ppo_loss(agent, args, coef, batch)
    coef["ent_coef"].fill_(0.5)
    loss1, _ = ppo.ppo_loss(agent, args, coef, batch)
    entropy = stats[ppo.LOSS_STATS.index("entropy")]
    torch.testing.assert_close(loss0 - loss1, (0.5 - args.ent_coef) * entropy)


def test_changing_a_coefficient_in_place_changes_the_compiled_loss_without_a_recompile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    agent = ppo.speed_up(ppo.Agent((4, 84, 84), N_ACTIONS), ppo.Args(compile=True))
    args = ppo.Args(compile=True)
    coef = ppo.loss_coefficients(args, CPU)
    batch = frames_and_batch(8)
    loss0, stats = agent.compiled_loss(agent, args, coef, batch)  # compiles
    entropy = stats[ppo.LOSS_STATS.index("entropy")]
    with torch.compiler.set_stance("fail_on_recompile"):  # raises if anything compiles again
        for value in (0.5, 0.0):
            coef["ent_coef"].fill_(value)
            loss, _ = agent.compiled_loss(agent, args, coef, batch)
            torch.testing.assert_close(loss0 - loss, (value - args.ent_coef) * entropy)
        args.clip_vloss = False  # the control: a change the graph does depend on is caught
        with pytest.raises(RuntimeError, match="Detected recompile"):
            agent.compiled_loss(agent, args, coef, batch)


def test_the_schedule_line_in_main_runs_uncommented_and_reaches_0_in_the_last_iteration(
    run_trainer, tmp_path
):
    line = '        # coef["ent_coef"].fill_(args.ent_coef * (1 - iteration / args.num_iterations))'
    value = line.split(".fill_(")[1][:-1]  # the scheduled value, as the line computes it
    args = ppo.Args(ent_coef=0.01, num_iterations=4)
    steps = [eval(value, {"args": args, "iteration": i}) for i in range(1, 5)]
    assert steps[0] > steps[1] > steps[2] > steps[3] == 0.0  # issue 43: it ended at coef / N
    edit = [(line, line.replace("# ", "", 1))]
    copy = edited_copy(tmp_path / "schedule", edit)
    assert "\n" + line.replace("# ", "", 1) + "\n" in copy.read_text()
    out = run_trainer(
        *tiny(),
        launcher=[sys.executable, str(copy)],
        timeout=300,
    )
    finished(out, 1)


# ---- 6. issue 36: resume across --compile; thread counts on CUDA -------------------------------
ADAM_KERNELS = {"foreach": {"foreach": True}, "fused": {"fused": True}}


def adam(agent, kernel):
    return torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5, **ADAM_KERNELS[kernel])


@pytest.mark.parametrize("saved_by, loaded_by", [("foreach", "fused"), ("fused", "foreach")])
def test_resume_across_compile_gives_the_loader_the_current_adam_kernel_flags(
    tmp_path, monkeypatch, saved_by, loaded_by
):
    monkeypatch.chdir(tmp_path)
    small = dict(local_num_envs=2, num_steps=32, num_minibatches=2, total_timesteps=256)
    writer = ppo.resolve_sizes(ppo.Args(compile=saved_by == "fused", **small), 1)
    torch.manual_seed(0)
    agent = ppo.Agent((4, 84, 84), N_ACTIONS)
    opt = adam(agent, saved_by)
    for p in agent.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # a state with `step` to load
    ckpt = {
        "model": agent.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": {},
        "iteration": 1,
        "global_step": 64,
        "args": vars(writer),
        "world_size": 1,
        "elapsed": 1.0,
    }
    path = str(tmp_path / "saved.pt")
    torch.save(ckpt, path)

    seen = []  # the kernel flags of the param group torch's loader placed each `step` by
    place = torch.optim.Optimizer._process_value_according_to_param_policy

    def spy(param, value, param_id, param_groups, key=None):
        if key == "step":
            group = next(g for g in param_groups if param_id in g["params"])
            seen.append((group.get("fused"), group.get("foreach")))
        return place(param, value, param_id, param_groups, key)

    monkeypatch.setattr(
        torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(spy)
    )
    args = ppo.resolve_sizes(ppo.Args(compile=loaded_by == "fused", resume=path, **small), 1)
    resumed = ppo.Agent((4, 84, 84), N_ACTIONS)
    current = adam(resumed, loaded_by)
    flags = (current.param_groups[0]["fused"], current.param_groups[0]["foreach"])
    assert flags != (opt.param_groups[0]["fused"], opt.param_groups[0]["foreach"])
    checkpointer = ppo.Checkpointer(args, "r", 0, 1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert checkpointer.resume(resumed, current, scaler) == 64
    assert seen == [flags] * len(list(resumed.parameters()))
    group = current.param_groups[0]
    assert (group["fused"], group["foreach"]) == flags
    for p in resumed.parameters():  # the loaded state trains on with this kernel
        p.grad = torch.ones_like(p)
    current.step()
    assert all(s["step"].item() == 2 for s in current.state.values())


def test_thread_counts_on_cuda_leave_torch_one_thread_and_give_the_emulators_the_cores(
    monkeypatch,
):
    monkeypatch.setattr(ppo.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    cuda = torch.device("cuda", 0)

    def counts(device, ranks=1, **kw):
        return ppo.thread_counts(ppo.Args(**kw), device, ranks)

    assert counts(cuda, local_num_envs=8) == (1, 8)  # at most one thread per env
    assert counts(cuda, local_num_envs=64) == (1, 15)  # the 15 cores torch leaves
    torch_threads, per_group = counts(cuda, local_num_envs=8, async_envs=True)
    assert torch_threads == 1 and per_group <= 4  # two groups of 4 envs
    assert counts(cuda, ranks=2, local_num_envs=64) == (1, 7)  # 8 cores per rank
    assert counts(CPU, local_num_envs=8) == (16, 16)  # CPU: torch and emulators share them
    assert counts(CPU, ranks=2, local_num_envs=8) == (8, 8)
    assert counts(CPU, ranks=2, local_num_envs=64, async_envs=True) == (8, 8)


# ---- 7. issue 43: a frozen encoder, BatchNorm, an auxiliary head, AdamW with a new flag -------
FREEZE_EDIT = [
    (
        "        self.network = nature_cnn(obs_shape)",
        "        self.network = nature_cnn(obs_shape).requires_grad_(False)  # frozen",
    )
]
FIRST_CONV = "        layer_init(nn.Conv2d(obs_shape[0], 32, 8, stride=4)),"
BATCH_NORM_EDIT = [(FIRST_CONV, FIRST_CONV + "\n        nn.BatchNorm2d(32),")]


# An auxiliary head that predicts the reward: its output by name in Agent, its term and statistic
# in ppo_loss (the target is the batch's `rewards`: the environment's own)
AUX_HEAD_EDIT = [
    (
        "        self.critic = layer_init(nn.Linear(width, 1), std=1)",
        "        self.critic = layer_init(nn.Linear(width, 1), std=1)\n"
        "        self.aux = layer_init(nn.Linear(width, 1), std=1)",
    ),
    (
        "            return out | dict(value=self.critic(features))  # by name: a new head, one "
        "more entry",
        "            return out | dict(value=self.critic(features), aux=self.aux(features)[:, 0])",
    ),
    (LOSS_STATS_LINE, LOSS_STATS_LINE[:-1] + ', "aux_loss")'),
    (
        '    loss = pg_loss - coef["ent_coef"] * entropy_loss + v_loss * coef["vf_coef"]',
        '    aux_loss = ((new["aux"] - mb["rewards"]) ** 2).mean()\n'
        '    loss = pg_loss - coef["ent_coef"] * entropy_loss + v_loss * coef["vf_coef"]\n'
        "    loss = loss + aux_loss\n"
        '    stats["aux_loss"] = aux_loss.detach()',
    ),
]


def test_a_frozen_encoder_batch_norm_and_an_auxiliary_head_train_on_two_ranks(
    run_trainer, tmp_path
):
    # three edits in one copy (one run): each its own local change, each checked below
    copy = edited_copy(tmp_path / "frozen-bn", FREEZE_EDIT + BATCH_NORM_EDIT + AUX_HEAD_EDIT)
    flags = [*tiny(ranks=2), "--grad-accum", "2", "--run-name", "f", "--save-interval", "1"]
    out = run_trainer(*flags, launcher=torchrun(2, script=copy), timeout=300)
    # every rank's weights AND buffers equal rank 0's: the running statistics are broadcast
    finished(out, 2)
    warning = "warning: --grad-accum under BatchNorm: each micro-batch's statistics"
    assert warning in out.stderr
    first = torch.load(tmp_path / "runs/f/checkpoints/ckpt_000000000128.pt", weights_only=True)
    final = torch.load(tmp_path / "runs/f/ppo_atari_multigpu.model", weights_only=True)
    for k, v in first["model"].items():  # after iteration 1 of 2
        frozen = k.startswith("network.") and "running_" not in k and "num_batches" not in k
        assert torch.equal(v, final[k]) == frozen, k  # the heads trained, the encoder did not
    assert final["network.1.num_batches_tracked"] > 0  # the BatchNorm ran in training mode
    logged = scalar_tags(tmp_path / "runs/f")["losses/aux_loss"]  # the head's statistic
    assert [step for step, _ in logged] == [128, 256] and all(v > 0 for _, v in logged)


def test_sizes_are_probed_in_eval_mode_without_touching_a_batch_norms_statistics(monkeypatch):
    def batch_norm_cnn(obs_shape):
        convs = nn.Sequential(nn.Conv2d(obs_shape[0], 8, 8, stride=4), nn.BatchNorm2d(8))
        convs.append(nn.Flatten())
        fc = nn.Linear(ppo.output_size(convs, obs_shape), 16)
        return nn.Sequential(*convs, fc, nn.BatchNorm1d(16), nn.ReLU())  # batch 1: eval only

    monkeypatch.setattr(ppo, "nature_cnn", batch_norm_cnn)
    agent = ppo.Agent((4, 84, 84), N_ACTIONS)
    assert agent.actor.in_features == 16 and agent.training and agent.network.training
    for bn in (agent.network[1], agent.network[4]):
        assert bn.num_batches_tracked == 0 and (bn.running_mean == 0).all()


WEIGHT_DECAY_EDIT = [
    (
        '    """coefficient of the value function"""',
        '    """coefficient of the value function"""\n'
        '    weight_decay: float = 0.01\n    """AdamW\'s decoupled weight decay"""\n',
    ),
    (
        "    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, **kernel)",
        "    optimizer = optim.AdamW(agent.parameters(), lr=args.learning_rate, eps=1e-5, "
        "weight_decay=args.weight_decay, **kernel)",
    ),
]


def test_adamw_with_a_new_flag_resumes_an_older_checkpoint_with_its_own_weight_decay(
    run_trainer, tmp_path
):
    finished(run_trainer(*tiny(), "--run-name", "w"), 1)  # Adam, before the edit
    copy = edited_copy(tmp_path / "adamw", WEIGHT_DECAY_EDIT)
    older = "runs/w/checkpoints/ckpt_000000000128.pt"
    flags = [*tiny(), "--run-name", "w", "--resume", older, "--total-timesteps", "256"]
    out = run_trainer(*flags, launcher=[sys.executable, str(copy)], timeout=300)
    finished(out, 1)
    assert f"{older} predates --weight-decay: this launch's values are used" in out.stdout
    ckpt = torch.load(tmp_path / "runs/w/checkpoints/ckpt_000000000256.pt", weights_only=True)
    group = ckpt["optimizer"]["param_groups"][0]
    assert group["weight_decay"] == 0.01 and group["decoupled_weight_decay"]  # not the file's


# ---- 8. issue 43: what the logged statistics and the rewards buffer hold -----------------------
# The trainer under a wrapper that registers Breakout cut after 400 frames (~100 steps: time
# limits come often) and counts the time-limit cuts; the copy prints each minibatch's approx_kl
# and asserts that the batch's rewards are the env's own (clipped: -1, 0 or 1).
SHORT_GAMES = """import atexit, runpy, sys
import gymnasium as gym, ale_py, numpy as np
gym.register_envs(ale_py)
kwargs = {**gym.spec("BreakoutNoFrameskip-v4").kwargs, "max_num_frames_per_episode": 400}
gym.register("BreakoutCutNoFrameskip-v4", entry_point="ale_py.env:AtariEnv", kwargs=kwargs)
step, cuts = gym.vector.SyncVectorEnv.step, []
def counted(self, actions):
    out = step(self, actions)
    cuts.append(int((out[3] & ~out[2]).sum()))
    return out
gym.vector.SyncVectorEnv.step = counted
atexit.register(lambda: print("time-limit cuts:", sum(cuts)))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
EACH_MINIBATCH_EDIT = [
    (
        STATS_LINE,
        STATS_LINE + '\n    print("minibatch approx_kl", stats["approx_kl"].item(), flush=True)\n'
        '    assert set(mb["rewards"].tolist()) <= {-1.0, 0.0, 1.0}, mb["rewards"]',
    )
]


def test_logged_losses_are_iteration_means_and_rewards_stay_the_envs_at_time_limits(
    run_trainer, tmp_path
):
    copy = edited_copy(tmp_path / "each-minibatch", EACH_MINIBATCH_EDIT)
    (tmp_path / "short.py").write_text(SHORT_GAMES)
    flags = [*tiny(num_steps=128), "--update-epochs", "2", "--env-id", "BreakoutCutNoFrameskip-v4"]
    out = run_trainer(*flags, "--run-name", "m", launcher=[sys.executable, "short.py", str(copy)])
    finished(out, 1)  # no assertion failed: the time-limit bootstraps are not in the rewards
    assert int(out.stdout.split("time-limit cuts: ")[1].split()[0]) >= 2  # each env's first cut
    printed = [float(x.split()[-1]) for x in out.stdout.splitlines() if x.startswith("minibatch ")]
    assert len(printed) == 2 * 2 * 2  # iterations x epochs x minibatches
    logged = [v for _, v in scalar_tags(tmp_path / "runs/m")["losses/approx_kl"]]
    for i, value in enumerate(logged):  # each iteration's mean, not its last minibatch's value
        assert value == pytest.approx(np.mean(printed[4 * i : 4 * i + 4]), rel=1e-5)
    assert len(set(printed[:4])) > 1  # (the mean differs from the last value)
