# Data-parallel PPO for Atari, in one file.
#   python ppo_atari_multigpu.py                                    # one process
#   torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py  # 2 ranks on this machine
# Every rank steps its own envs and computes gradients on its own samples; before each optimizer
# step ONE flat buffer holding all gradients is all-reduced and averaged, so every replica takes
# the same step and the weights stay bit-identical across ranks.
import atexit
import contextlib
import ctypes
import datetime
import difflib
import glob
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, Optional

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import tyro
from torch.distributions.categorical import Categorical
from ale_py.vector_env import AtariVectorEnv
from torch.utils.tensorboard import SummaryWriter

gym.register_envs(ale_py)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (env i of rank r gets seed + r * local_num_envs + i)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be used when available"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "cleanRL"
    """the wandb's project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of wandb's project"""
    capture_video: bool = False
    """whether to capture videos of the agent performances (rank 0, env 0) to `videos/<run_name>`"""
    run_name: Optional[str] = None
    """the run's directory name under runs/ (default: {env_id}__{exp_name}__{seed}__{timestamp})"""

    # Distributed settings
    backend: Literal["auto", "gloo", "nccl", "mpi"] = "auto"
    """collective backend; auto = nccl when every rank has its own GPU, else gloo"""
    device_ids: Optional[list[int]] = None
    """GPU of each rank, e.g. `--device-ids 0 0 1 1` (one id per rank; default: local rank)"""
    threads: Optional[int] = None
    """torch CPU threads per rank (default: cores // ranks on this node, at least 1)"""
    pg_timeout: float = 600.0
    """seconds a collective may wait for a peer before the run fails (a dead rank ends the run)"""

    # Checkpoints, resume and evaluation
    save_interval: int = 50
    """save a checkpoint every this many iterations, and always at the end (0: only at the end)"""
    save_minutes: float = 0.0
    """also save when this many minutes have passed since the last checkpoint (0: off)"""
    keep_checkpoints: int = 3
    """how many of the latest checkpoints to keep in runs/<run_name>/checkpoints"""
    resume: Optional[str] = None
    """`auto`: continue from this run's latest checkpoint (or start fresh if none); or a checkpoint path"""
    eval_episodes: int = 10
    """full games played by the final model, logged as eval/episodic_return (0: skip)"""
    eval_checkpoint: Optional[str] = None
    """evaluation only: load this model or checkpoint, play --eval-episodes games, print the returns"""

    # Performance (README "Performance"): the defaults keep CleanRL's math
    channels_last: bool = True
    """keep conv weights channels-last: faster oneDNN/cuDNN kernels, same math (other rounding)"""
    amp: Literal["none", "bf16", "fp16"] = "none"
    """autocast precision for rollout and update (fp16 adds a GradScaler); opt-in: changes the numbers"""
    compile: bool = False
    """torch.compile the convolutional trunk"""
    env_backend: Literal["sync", "native"] = "sync"
    """sync: gymnasium SyncVectorEnv in this process; native: ale-py's C++ AtariVectorEnv (threads)"""
    async_envs: bool = False
    """two env groups: one steps (C++ threads or subprocesses) while the policy acts for the other"""

    # Algorithm specific arguments
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    total_timesteps: int = 10000000
    """total timesteps of the experiments (all ranks together)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: Optional[int] = None
    """the number of parallel game environments per rank (default 8)"""
    num_envs: Optional[int] = None
    """the number of parallel game environments of all ranks (= local_num_envs * world size)"""
    num_steps: Optional[int] = None
    """the number of steps to run in each environment per policy rollout (default 128)"""
    local_batch_size: Optional[int] = None
    """samples per rank per rollout (= local_num_envs * num_steps)"""
    local_minibatch_size: Optional[int] = None
    """samples per rank per minibatch (= local_batch_size / num_minibatches)"""
    num_minibatches: Optional[int] = None
    """the number of mini-batches (default 4)"""
    anneal_lr: bool = True
    """Toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """Toggles advantages normalization (per minibatch, statistics of the global minibatch)"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper."""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: Optional[float] = None
    """the target KL divergence threshold (the KL averaged over all ranks decides)"""
    grad_accum: int = 1
    """split each local minibatch into this many micro-batches (less memory, same gradient)"""

    # to be filled in runtime
    world_size: int = 1
    """the number of ranks (computed in runtime)"""
    batch_size: int = 0
    """the batch size of all ranks (computed in runtime)"""
    minibatch_size: int = 0
    """the mini-batch size of all ranks (computed in runtime)"""
    num_iterations: int = 0
    """the number of iterations (computed in runtime)"""


def resolve_sizes(args: Args, world_size: int) -> Args:
    """Derive every batch size from the subset the user gave; refuse inconsistent ones."""

    def need(cond, msg):
        if not cond:
            raise ValueError(msg)

    for name in ("local_num_envs", "num_envs", "num_steps", "local_batch_size", "local_minibatch_size",
                 "num_minibatches", "grad_accum", "total_timesteps", "update_epochs"):
        value = getattr(args, name)
        need(value is None or value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
    envs, steps, lbs = args.local_num_envs, args.num_steps, args.local_batch_size
    if args.num_envs is not None:
        need(args.num_envs % world_size == 0,
             f"--num-envs {args.num_envs} is not divisible by the world size {world_size}")
        need(envs is None or envs * world_size == args.num_envs,
             f"--num-envs {args.num_envs} != --local-num-envs {envs} x world size {world_size}")
        envs = args.num_envs // world_size
    if envs is None:
        envs = lbs // steps if lbs is not None and steps is not None else 8
    if steps is None:
        need(lbs is None or lbs % envs == 0,
             f"--local-batch-size {lbs} is not divisible by --local-num-envs {envs}")
        steps = lbs // envs if lbs is not None else 128
    need(lbs is None or lbs == envs * steps,
         f"--local-batch-size {lbs} != --local-num-envs {envs} x --num-steps {steps}")
    lbs = envs * steps
    if args.local_minibatch_size is not None:
        mbs = args.local_minibatch_size
        need(lbs % mbs == 0, f"--local-minibatch-size {mbs} does not divide --local-batch-size {lbs}")
        need(args.num_minibatches is None or args.num_minibatches * mbs == lbs,
             f"--num-minibatches {args.num_minibatches} x --local-minibatch-size {mbs} != "
             f"--local-batch-size {lbs}")
        n_mb = lbs // mbs
    else:
        n_mb = args.num_minibatches if args.num_minibatches is not None else 4
        need(lbs % n_mb == 0, f"--num-minibatches {n_mb} does not divide --local-batch-size {lbs}")
    mbs = lbs // n_mb
    need(mbs % args.grad_accum == 0,
         f"--grad-accum {args.grad_accum} does not divide --local-minibatch-size {mbs}")
    need(args.total_timesteps >= lbs * world_size,
         f"--total-timesteps {args.total_timesteps} is less than one rollout of all ranks "
         f"({lbs * world_size} = --local-batch-size {lbs} x world size {world_size})")
    args.local_num_envs, args.num_envs, args.num_steps = envs, envs * world_size, steps
    args.local_batch_size, args.local_minibatch_size, args.num_minibatches = lbs, mbs, n_mb
    args.world_size, args.batch_size, args.minibatch_size = world_size, lbs * world_size, mbs * world_size
    args.num_iterations = args.total_timesteps // args.batch_size
    return args


def check_env_id(env_id: str):
    if env_id not in gym.registry:
        close = difflib.get_close_matches(env_id, list(gym.registry.keys()), n=1, cutoff=0.6)
        raise ValueError(f"unknown env id {env_id!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if not str(gym.spec(env_id).entry_point).startswith("ale_py"):
        raise ValueError(f"env id {env_id!r} is not an Atari (ale-py) environment")


class EpisodicLife(gym.Wrapper):
    """A lost life ends the learning episode, but the game is only reset at game over (as in
    the DQN/baselines setup); gymnasium's own terminal_on_life_loss would reset the game."""

    def __init__(self, env):
        super().__init__(env)
        self.lives, self.game_over = 0, True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.env.unwrapped.ale.lives()
        terminated = terminated or 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        obs, info = None, {}
        seeded = kwargs.get("seed") is not None or kwargs.get("options") is not None
        if not self.game_over and not seeded:  # a life was lost: continue the same game with a no-op
            obs, _, terminated, truncated, info = self.env.step(0)
            self.game_over = terminated or truncated
        if self.game_over or seeded:
            obs, info = self.env.reset(**kwargs)
            self.game_over = False
        self.lives = self.env.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """Press FIRE after each reset: games like Breakout stay frozen until it is pressed."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


def make_env(env_id, idx, capture_video, run_name, episodic_life=True):
    def thunk():
        # v5 ids skip 4 frames inside the emulator; frames must be skipped once, in AtariPreprocessing
        kwargs = {"frameskip": 1} if gym.spec(env_id).kwargs.get("frameskip", 1) != 1 else {}
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array", **kwargs)
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id, **kwargs)
        env = gym.wrappers.RecordEpisodeStatistics(env)  # innermost: the real game's return and length
        env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84,
                                              terminal_on_life_loss=False, grayscale_obs=True)
        if episodic_life:  # off for evaluation: a game then ends only at game over
            env = EpisodicLife(env)
        if env.unwrapped.get_action_meanings()[1] == "FIRE":
            env = FireReset(env)
        env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))
        env = gym.wrappers.FrameStackObservation(env, 4)
        return env

    return thunk


class NativeVectorEnv:
    """--env-backend native: ale-py's C++ vector env (threads), behind the SyncVectorEnv API and
    info format the rollout loop reads, with our pipeline's semantics (README "Performance")."""

    def __init__(self, env_id, num_envs, num_threads):
        kw = gym.spec(env_id).kwargs  # "BreakoutNoFrameskip-v4" -> game "breakout", sticky actions, time limit
        self.env = AtariVectorEnv(
            kw["game"], num_envs, num_threads=num_threads, batch_size=num_envs, autoreset_mode="SameStep",
            frameskip=4, maxpool=True, noop_max=30, use_fire_reset=True, grayscale=True, img_height=84, img_width=84,
            stack_num=1,  # we stack: a new life/game starts from 4 copies of its first frame, as FrameStackObservation
            episodic_life=False,  # True would reset the whole game at every life loss; instead
            life_loss_info=True,  # a life loss only sets terminated, and the game goes on
            reward_clipping=False,  # the episode return must be the real score; we clip the agent's reward
            repeat_action_probability=kw.get("repeat_action_probability", 0.25),
            full_action_space=kw.get("full_action_space", False),
            max_num_frames_per_episode=kw.get("max_num_frames_per_episode", 108000))
        self.num_envs = num_envs
        self.single_observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        self.single_action_space = self.env.single_action_space
        self.fire = self.env.ale.get_action_set()[1] == ale_py.Action.FIRE  # as the trainer's FireReset

    def _info(self, info):
        # frame_number - episode_frame_number is constant during a game and jumps when ale-py resets it
        self.offset = info["frame_number"].astype(np.int64) - info["episode_frame_number"]
        out = {}
        for key in ("lives", "episode_frame_number", "frame_number"):  # gymnasium style: value + "_key" mask
            out[key], out["_" + key] = info[key].astype(np.int64), np.ones(self.num_envs, bool)
        return out

    def reset(self, seed=None):
        if seed is not None:  # an int: env i gets seed + i (as gymnasium); else one seed per env
            seed = int(seed) if np.ndim(seed) == 0 else np.asarray(seed, dtype=np.int64)
        frame, info = self.env.reset(seed=seed)
        self.returns = np.zeros(self.num_envs)  # unclipped score of the running game, all lives
        self.fire_next = np.zeros(self.num_envs, bool)
        self.stack = np.repeat(frame, 4, axis=1)
        return self.stack, self._info(info)

    def step(self, actions):
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions):  # the C++ threads step while Python goes on (--async-envs)
        actions = np.asarray(actions, dtype=np.int64)
        if self.fire:
            # ale-py presses FIRE only when a game starts, and games like Breakout stay frozen after a
            # lost life until FIRE is pressed: the step after a life loss presses FIRE instead of the
            # agent's action. The trainer still records that step with the agent's sampled action.
            actions = np.where(self.fire_next, 1, actions)
        self.env.send(actions)

    def step_wait(self):
        frame, reward, term, trunc, info = self.env.recv()
        old_offset = self.offset
        infos = self._info(info)
        # A game ended (game over or time limit) exactly when ale-py reset it this step: the episode
        # frame counter restarted while the global one went on. The old game lasted offset - old_offset
        # raw frames (reset no-ops and FIRE included), like RecordEpisodeStatistics on the raw env.
        game_over = self.offset != old_offset
        self.returns += reward
        done = term | trunc
        self.fire_next = term & ~game_over  # a life was lost and the game goes on
        last = np.concatenate([self.stack[:, 1:], frame], axis=1)
        if game_over.any():  # SAME_STEP: `frame` is already the new game's first frame there
            last[game_over, 3] = info["final_obs"][game_over, 0]
        # New life or game: 4 copies of its first frame. np.where makes a new array every step, so an
        # obs handed out earlier (maybe shared by a CPU torch tensor) is never overwritten.
        self.stack = np.where(done[:, None, None, None], frame, last)
        if done.any():  # as gymnasium, but final_obs is one (N,4,84,84) array (valid where done)
            infos.update(final_obs=last, _final_obs=done, final_info={}, _final_info=done)
            if game_over.any():
                infos["final_info"] = {"episode": {"r": np.where(game_over, self.returns, 0.0),
                                                   "l": np.where(game_over, self.offset - old_offset, 0)},
                                       "_episode": game_over}
        self.returns[game_over] = 0.0
        return self.stack, np.sign(reward).astype(np.float64), term, trunc, infos

    def close(self):
        self.env.close()


def merge_infos(parts, sizes):
    """--async-envs: one info dict from those of the env groups (gymnasium's layout: per-env
    arrays and '_key' masks; where a group lacks a key, its rows are zeros / False)."""
    out = {}
    for key in set().union(*parts):
        values = [part.get(key) for part in parts]
        if any(isinstance(v, dict) for v in values):
            out[key] = merge_infos([v or {} for v in values], sizes)
        else:
            ref = next(v for v in values if v is not None)
            out[key] = np.concatenate([np.zeros((n,) + ref.shape[1:], ref.dtype) if v is None else v
                                       for v, n in zip(values, sizes)])
    return out


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, num_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def hidden(self, x):
        # uint8 frames go channels-last BEFORE the float division when the weights are: oneDNN
        # would otherwise reorder a 4x larger float copy on every call
        if self.network[0].weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return self.network(x / 255.0).float()

    def get_value(self, x):
        hidden = self.hidden(x)
        with torch.autocast(x.device.type, enabled=False):  # heads in fp32 even under --amp
            return self.critic(hidden)

    def get_action_and_value(self, x, action=None):
        hidden = self.hidden(x)
        # fp32 heads even under --amp: PPO's ratio exp(new - old log-prob) needs more than bf16's
        # 8 mantissa bits. No validation: a NaN must reach the non-finite check, not raise in torch.
        with torch.autocast(x.device.type, enabled=False):
            probs = Categorical(logits=self.actor(hidden), validate_args=False)
            if action is None:
                action = probs.sample()
            return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """dones[t] = 1 means obs[t] starts a new episode, so the return from t-1 stops there."""
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    num_steps = rewards.shape[0]
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal, nextvalues = 1.0 - next_done, next_value
        else:
            nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


def normalize_advantages(adv, world_size):
    # Statistics of the GLOBAL minibatch (the union over ranks), not of the local one: then the
    # rank-averaged gradient equals the single-process gradient on that union exactly.
    n = adv.numel() * world_size  # every rank's minibatch has the same size
    s = torch.stack([adv.sum(), (adv * adv).sum()]).double()
    if world_size > 1:
        dist.all_reduce(s)
    mean = s[0] / n
    std = ((s[1] - n * mean * mean) / (n - 1)).clamp(min=0).sqrt()
    return (adv - mean.float()) / (std.float() + 1e-8)


NUM_STATS = 6  # pg_loss, v_loss, entropy, old_approx_kl, approx_kl, clipfrac


def ppo_loss(agent, args, obs, actions, logprobs, advantages, returns, values):
    """The clipped PPO loss of one (micro-)batch, and its statistics as one small tensor."""
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)
    logratio = newlogprob - logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    pg_loss = torch.max(-advantages * ratio,
                        -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
    newvalue = newvalue.view(-1)
    if args.clip_vloss:
        v_clipped = values + torch.clamp(newvalue - values, -args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    stats = torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()
    return loss, stats


def flat_grad_buffer(params, extra):
    """One buffer for all gradients (each .grad is a view into it, with its parameter's strides,
    e.g. channels-last) plus `extra` slots at the end for statistics: a single all_reduce then
    averages both, with no cat / copy-back."""
    flat = torch.zeros(sum(p.numel() for p in params) + extra, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat.as_strided(p.shape, p.stride(), offset)
        offset += p.numel()
    return flat


def minibatch_gradient(agent, args, flat_grads, n_params, batch, mb_inds, world_size,
                       autocast=contextlib.nullcontext(), scaler=None):
    """Leave in flat_grads the gradient of one minibatch averaged over all ranks (scaled by the
    fp16 GradScaler if any), followed by its averaged statistics. Returns the all-reduce seconds."""
    b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values = batch
    mb_advantages = b_advantages[mb_inds]
    if args.norm_adv:
        mb_advantages = normalize_advantages(mb_advantages, world_size)
    flat_grads.zero_()  # not optimizer.zero_grad(): that would drop the views into flat_grads
    micro = len(mb_inds) // args.grad_accum
    for m in range(0, len(mb_inds), micro):  # gradient accumulation: sum of micro-batch means / K
        i = mb_inds[m : m + micro]
        with autocast:
            loss, stats = ppo_loss(agent, args, b_obs[i], b_actions[i], b_logprobs[i],
                                   mb_advantages[m : m + micro], b_returns[i], b_values[i])
        (loss / args.grad_accum if scaler is None else scaler.scale(loss / args.grad_accum)).backward()
        flat_grads[n_params:] += stats / args.grad_accum
    if world_size == 1:
        return 0.0
    t = time.perf_counter()
    dist.all_reduce(flat_grads)  # SUM, then divide: gloo has no AVG
    flat_grads /= world_size
    return time.perf_counter() - t


def keep_freed_memory():
    """glibc gives each freed block above its mmap threshold back to the OS, so every minibatch
    page-faults its ~14 MB of activations in again (1.3 M faults in 8 iterations of 1x4, measured).
    Keep freed memory in the process instead; nothing changes where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve blocks up to 1 GiB from the heap
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never shrink the heap


# ---- checkpoints: atomic writes, validated reads, RNG states of every rank ----
def rng_state():
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # stored as tensors: loads with weights_only
    return {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos,
                                                   has_gauss, cached), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(ckpt, ckpt_dir, keep):
    """Write to a temp file, fsync, then rename: a crash mid-write leaves only a *.tmp file, which
    neither `--resume auto` nor the pruning below ever picks up."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"ckpt_{ckpt['iteration']:08d}.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    dir_fd = os.open(ckpt_dir, os.O_RDONLY)  # make the rename itself durable
    os.fsync(dir_fd)
    os.close(dir_fd)
    for old in sorted(glob.glob(os.path.join(ckpt_dir, "ckpt_*.pt")))[:-keep]:
        os.remove(old)
    return path


def latest_checkpoint(ckpt_dir):
    found = sorted(glob.glob(os.path.join(ckpt_dir, "ckpt_*.pt")))
    return found[-1] if found else None


def load_checkpoint(path, num_actions):
    """A checkpoint (or a bare model state_dict) that fits this env and network, or ValueError."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} does not exist")
    except Exception as e:
        raise ValueError(f"checkpoint {path} is unreadable (truncated or corrupt?): {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:160]}")
    ckpt = ckpt if isinstance(ckpt, dict) and "model" in ckpt else {"model": ckpt}
    model = ckpt["model"]
    if not isinstance(model, dict) or "actor.weight" not in model:
        raise ValueError(f"checkpoint {path} holds no PPO Atari model")
    if model["actor.weight"].shape[0] != num_actions:
        raise ValueError(f"checkpoint {path} was trained with {model['actor.weight'].shape[0]} actions "
                         f"({ckpt.get('args', {}).get('env_id', 'unknown env')}); this env has {num_actions}")
    try:
        Agent(num_actions).load_state_dict(model)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {path} does not fit the network: {' '.join(str(e).split())[:200]}")
    return ckpt


def evaluate(agent, env_id, episodes, device, capture_video, run_name, seed):
    """Real game returns of `episodes` full games (episodic life off), one game per env at a time;
    each env contributes the same number of games, so short games are not over-represented."""
    n_envs = min(episodes, 16)
    quota = math.ceil(episodes / n_envs)
    envs = gym.vector.SyncVectorEnv(
        [make_env(env_id, i, capture_video, f"{run_name}-eval", episodic_life=False) for i in range(n_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    games = [[] for _ in range(n_envs)]
    next_obs, _ = envs.reset(seed=env_seeds(seed + 10**6, 0, n_envs))  # unseen games
    while min(len(g) for g in games) < quota:
        with torch.inference_mode():
            action, _, _, _ = agent.get_action_and_value(torch.as_tensor(next_obs, device=device))
        next_obs, _, _, _, infos = envs.step(action.cpu().numpy())
        if "final_info" in infos and "episode" in infos["final_info"]:
            for i in np.flatnonzero(infos["final_info"]["_episode"]):
                games[i].append(float(infos["final_info"]["episode"]["r"][i]))
    envs.close()
    return [g[k] for k in range(quota) for g in games][:episodes]


def env_seeds(seed, rank, local_num_envs):
    return [seed + rank * local_num_envs + i for i in range(local_num_envs)]


def explain_crash(exc_type, exc, tb):
    """Keep the traceback, but end with one line that says which rank failed and why; a failed
    collective nearly always means that a peer died or hung, which gloo/nccl do not say plainly."""
    sys.__excepthook__(exc_type, exc, tb)
    msg = (str(exc).strip().splitlines() or [exc_type.__name__])[0][:300]
    if dist.is_initialized() and isinstance(exc, RuntimeError) and any(
            k in msg for k in ("Timed out", "timed out", "closed by peer", "Connection reset", "NCCL")):
        msg = f"a collective failed: a peer rank died or stopped responding (--pg-timeout {args.pg_timeout:g}s) [{msg}]"
    print(f"error [rank {rank}]: {exc_type.__name__}: {msg}", file=sys.stderr, flush=True)


def fail(msg, rank=0, world_size=1):
    print(f"error{f' [rank {rank}]' if world_size > 1 else ''}: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
    args = tyro.cli(Args)

    # torchrun sets these; plain `python` runs as a single process without a process group.
    distributed = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    master_process = rank == 0
    sys.excepthook = explain_crash

    # Validate everything BEFORE any collective: every rank reaches the same verdict and exits,
    # so bad input can never leave a peer waiting in a collective.
    try:
        resolve_sizes(args, world_size)
        check_env_id(args.env_id)
    except ValueError as e:
        fail(e, rank, world_size)
    if args.async_envs and args.local_num_envs < 2:
        fail(f"--async-envs splits each rank's envs into two groups: needs --local-num-envs >= 2, got "
             f"{args.local_num_envs}", rank, world_size)
    if args.capture_video and args.env_backend == "native":
        fail("--capture-video records through gymnasium: use it with --env-backend sync", rank, world_size)
    use_cuda = args.cuda and torch.cuda.is_available()
    if args.device_ids is not None and len(args.device_ids) != world_size:
        fail(f"--device-ids has {len(args.device_ids)} ids for world size {world_size}", rank, world_size)
    if use_cuda:
        gpus = args.device_ids or [r % local_world_size % torch.cuda.device_count() for r in range(world_size)]
        if max(gpus) >= torch.cuda.device_count():
            fail(f"--device-ids {gpus} names a GPU this node lacks ({torch.cuda.device_count()} GPUs)",
                 rank, world_size)
        device = torch.device("cuda", gpus[rank])
        torch.cuda.set_device(device)
        # ranks rank//local_world_size share a node; nccl refuses two ranks on one GPU of a node
        nodes = [gpus[i : i + local_world_size] for i in range(0, world_size, local_world_size)]
        shared_gpu = any(len(set(node)) < len(node) for node in nodes)
    else:
        device, shared_gpu = torch.device("cpu"), False
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda and not shared_gpu else "gloo")
    if backend == "nccl" and not use_cuda:
        fail("--backend nccl needs CUDA, but this rank has no GPU (or --no-cuda was given); "
             "use --backend gloo", rank, world_size)
    if backend == "nccl" and shared_gpu:
        fail(f"nccl refuses two ranks on one GPU (ranks -> GPUs: {gpus}); use --backend gloo", rank, world_size)
    if backend == "mpi" and not dist.is_mpi_available():
        fail("--backend mpi: this torch build has no MPI support", rank, world_size)
    # ranks on one node share its cores; torchrun's OMP_NUM_THREADS=1 would leave cores idle
    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // local_world_size))
    keep_freed_memory()

    # ---- evaluation-only mode: rank 0 plays --eval-episodes games with a saved model ----
    if args.eval_checkpoint:
        if master_process:
            agent = Agent(gym.make(args.env_id).action_space.n).to(device)
            try:
                agent.load_state_dict(load_checkpoint(args.eval_checkpoint, agent.actor.out_features)["model"])
            except ValueError as e:
                fail(e)
            returns = evaluate(agent, args.env_id, args.eval_episodes, device, args.capture_video,
                               os.path.basename(args.eval_checkpoint), args.seed)
            print(f"eval {args.eval_checkpoint} on {args.env_id}: {len(returns)} episodes, return "
                  f"{np.mean(returns):.2f} +- {np.std(returns):.2f} (min {min(returns):g}, max {max(returns):g})")
        sys.exit(0)

    if distributed:
        timeout = datetime.timedelta(seconds=args.pg_timeout)
        store = None
        if backend != "mpi":
            # torchrun keeps one key-value store across --max-restarts: a per-attempt prefix stops
            # restarted ranks from reading the addresses of the ranks they replace
            store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, timeout=timeout,
                is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"))
        # the global RANK (not LOCAL_RANK) names this process in the group: right on many nodes
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif master_process:
        print("single process (launch with `torchrun --nproc_per_node=N` for data parallelism)")

    # One run name for all ranks, decided by rank 0: with `--resume auto` the latest run of this
    # env/exp/seed that has a checkpoint (so a restarted job finds its own), else a new timestamp.
    run_name = [args.run_name]
    if master_process and run_name[0] is None:
        prefix = f"{args.env_id}__{args.exp_name}__{args.seed}__"
        earlier = sorted(glob.glob(f"runs/{prefix}*/checkpoints/ckpt_*.pt"), key=os.path.getmtime)
        run_name = [os.path.relpath(earlier[-1], "runs").split(os.sep + "checkpoints")[0]
                    if args.resume == "auto" and earlier else f"{prefix}{int(time.time())}"]
    if distributed:
        dist.broadcast_object_list(run_name, src=0)
    run_name = args.run_name = run_name[0]
    ckpt_dir = f"runs/{run_name}/checkpoints"

    if master_process:
        print(f"run {run_name}: {world_size} rank(s), backend {backend if distributed else '-'}, "
              f"device {device.type}, {torch.get_num_threads()} thread(s) per rank")
        print(f"  local_num_envs {args.local_num_envs:>5} | num_envs {args.num_envs:>6} | "
              f"num_steps {args.num_steps}\n  local_batch_size {args.local_batch_size:>3} | "
              f"batch_size {args.batch_size:>4} | num_minibatches {args.num_minibatches}\n"
              f"  local_minibatch_size {args.local_minibatch_size} | minibatch_size {args.minibatch_size} | "
              f"grad_accum {args.grad_accum} | num_iterations {args.num_iterations}")
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=vars(args), name=run_name, monitor_gym=True, save_code=True)

    # Seeding: distinct env seeds on every rank; python/numpy/torch streams differ per rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # ---- environments: one group, or two for --async-envs (double buffering) ----
    groups = [range(args.local_num_envs)] if not args.async_envs else [
        range(args.local_num_envs // 2), range(args.local_num_envs // 2, args.local_num_envs)]
    if args.env_backend == "native":
        env_groups = [NativeVectorEnv(args.env_id, len(g), num_threads=torch.get_num_threads()) for g in groups]
    else:
        vector_env = gym.vector.AsyncVectorEnv if args.async_envs else gym.vector.SyncVectorEnv
        env_groups = [vector_env([make_env(args.env_id, i, args.capture_video and master_process, run_name)
                                  for i in g],
                                 autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)  # no fake transitions
                      for g in groups]
    envs = env_groups[0]  # for the spaces
    agent = Agent(envs.single_action_space.n).to(device)
    if distributed:  # every replica starts from rank 0's weights
        flat_params = nn.utils.parameters_to_vector(agent.parameters())
        dist.broadcast(flat_params, src=0)
        nn.utils.vector_to_parameters(flat_params, agent.parameters())
    if args.channels_last:
        agent = agent.to(memory_format=torch.channels_last)
    if args.compile:
        # compile the forward only: the module, its state_dict keys and checkpoints stay as they are
        agent.network.forward = torch.compile(agent.network.forward)
    # ---- mixed precision (opt-in): one autocast context for rollout and update ----
    autocast = contextlib.nullcontext() if args.amp == "none" else torch.autocast(
        device.type, dtype=torch.bfloat16 if args.amp == "bf16" else torch.float16)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    # foreach: one kernel per op over all tensors, bit-identical to the per-tensor loop that torch
    # picks by default on CPU, and ~2x faster there (CUDA already defaults to it)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, foreach=True)
    params = list(agent.parameters())
    n_params = sum(p.numel() for p in params)
    flat_grads = flat_grad_buffer(params, NUM_STATS)

    # ---- resume: rank 0 reads the checkpoint and sends it to every rank (no shared disk needed) ----
    start_iteration, global_step, elapsed_before, ckpt = 1, 0, 0.0, None
    if args.resume and master_process:
        path = latest_checkpoint(ckpt_dir) if args.resume == "auto" else args.resume
        try:
            ckpt = load_checkpoint(path, envs.single_action_space.n) if path else None
        except ValueError as e:
            ckpt = str(e)  # every rank must hear about it, not just rank 0
    if args.resume and distributed:
        box = [ckpt]
        dist.broadcast_object_list(box, src=0)
        ckpt = box[0]
    if isinstance(ckpt, str):
        fail(ckpt, rank, world_size)
    if ckpt is not None:
        agent.load_state_dict(ckpt["model"])  # copies in place: the grad views stay valid
        optimizer.load_state_dict(ckpt["optimizer"])
        global_step, elapsed_before = ckpt["global_step"], ckpt["elapsed"]
        start_iteration = global_step // args.batch_size + 1
        if ckpt["world_size"] == world_size:
            set_rng_state(ckpt["rng"][rank])
        if master_process:
            print(f"resumed {path}: iteration {start_iteration}, global step {global_step}; environments "
                  f"start fresh" + ("" if ckpt["world_size"] == world_size else
                                    f"; world size {ckpt['world_size']} -> {world_size}, RNGs not restored"))
    if master_process:
        # purge_step: TensorBoard hides what a crashed run logged after its last checkpoint
        writer = SummaryWriter(f"runs/{run_name}", purge_step=global_step + 1 if ckpt else None)
        atexit.register(writer.close)  # flush the logs even when the run fails
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n%s" % (
            "\n".join([f"|{key}|{value}|" for key, value in vars(args).items()])))

    # Rollout storage (observations stay uint8: a float copy would be 4x the memory)
    obs = torch.zeros((args.num_steps, args.local_num_envs) + envs.single_observation_space.shape,
                      dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, args.local_num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    values = torch.zeros((args.num_steps, args.local_num_envs), device=device)

    recent_returns = deque(maxlen=100)
    num_episodes = 0
    start_time = last_save = time.time()
    # a resumed run gets fresh envs with seeds no earlier start used
    seeds = env_seeds(args.seed + global_step, rank, args.local_num_envs)
    next_obs = np.concatenate([e.reset(seed=[seeds[i] for i in g])[0] for e, g in zip(env_groups, groups)])
    next_obs = torch.as_tensor(next_obs, device=device)
    next_done = torch.zeros(args.local_num_envs, device=device)

    for iteration in range(start_iteration, args.num_iterations + 1):
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # ---- rollout ----
        t_rollout, env_time, episodes = time.perf_counter(), 0.0, []
        # One no-grad/autocast region for the whole rollout: the weights do not change in it, so under
        # --amp their low-precision copies are cast once, not every step. Not inference_mode: autocast
        # caches no casts there (bf16 batch-4 forward 2.1 vs 1.6 ms measured; fp32 the same).
        with torch.no_grad(), autocast:
            for step in range(args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done
                if not args.async_envs:
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                else:  # the first group's envs step while the policy acts for the second (on-policy:
                    # every action comes from the same weights)
                    parts = []
                    for e, g in zip(env_groups, groups):
                        parts.append(agent.get_action_and_value(next_obs[g.start : g.stop]))
                        e.step_async(parts[-1][0].cpu().numpy())
                    action, logprob, _, value = (torch.cat(x) for x in zip(*parts))
                values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob

                t_env = time.perf_counter()
                if not args.async_envs:
                    next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                else:
                    results = [e.step_wait() for e in env_groups]
                    next_obs_np, reward, terminations, truncations = (np.concatenate(x)
                                                                      for x in zip(*[r[:4] for r in results]))
                    infos = merge_infos([r[4] for r in results], [len(g) for g in groups])
                env_time += time.perf_counter() - t_env
                if "final_info" in infos:
                    # A time limit is not a real end: bootstrap from the value of the final observation
                    cut = np.flatnonzero(truncations & ~terminations)
                    if len(cut):
                        final_value = agent.get_value(torch.as_tensor(np.stack(infos["final_obs"][cut]), device=device))
                        reward[cut] += args.gamma * final_value.flatten().cpu().numpy()
                    if "episode" in infos["final_info"]:
                        ep = infos["final_info"]["episode"]
                        for i in np.flatnonzero(infos["final_info"]["_episode"]):
                            episodes.append((global_step, float(ep["r"][i]), int(ep["l"][i])))
                rewards[step] = torch.as_tensor(reward, device=device)
                next_obs = torch.as_tensor(next_obs_np, device=device)
                next_done = torch.as_tensor(terminations | truncations, dtype=torch.float32, device=device)
        rollout_time = time.perf_counter() - t_rollout

        # ---- advantages (GAE) ----
        t_update = time.perf_counter()
        with torch.no_grad(), autocast:
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages, returns = compute_gae(rewards, values, dones, next_value, next_done,
                                              args.gamma, args.gae_lambda)
        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape(-1)
        b_advantages, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)

        # ---- PPO update: one all-reduce of the flat gradient buffer per minibatch ----
        batch = (b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values)
        b_inds = np.arange(args.local_batch_size)
        clipfrac_sum, num_updates, allreduce_time = torch.zeros((), device=device), 0, 0.0
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, args.local_batch_size, args.local_minibatch_size):
                mb_inds = b_inds[start : start + args.local_minibatch_size]
                allreduce_time += minibatch_gradient(agent, args, flat_grads, n_params, batch, mb_inds,
                                                     world_size, autocast, scaler)
                if scaler is None:
                    nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                    optimizer.step()
                else:  # fp16: unscale before clipping; a step with inf/NaN is skipped on every rank alike
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                    scaler.step(optimizer)
                    scaler.update()
                clipfrac_sum += flat_grads[n_params + 5]
                num_updates += 1
            # every rank reads the same all-reduced KL, so every rank stops at the same step
            if args.target_kl is not None and flat_grads[n_params + 4].item() > args.target_kl:
                break
        update_time = time.perf_counter() - t_update

        # ---- stop on non-finite numbers before they can reach a checkpoint (same verdict on all ranks) ----
        if not torch.isfinite(flat_grads[n_params:]).all():
            fail(f"non-finite loss at iteration {iteration}, global step {global_step}: " + ", ".join(
                f"{k}={v:g}" for k, v in zip(("policy_loss", "value_loss", "entropy", "old_approx_kl",
                                               "approx_kl", "clipfrac"), flat_grads[n_params:].tolist())),
                 rank, world_size)
        if scaler is None and not torch.isfinite(flat_grads[:n_params]).all():
            fail(f"non-finite gradient at iteration {iteration}, global step {global_step}", rank, world_size)

        # ---- logging: episodes and timings of every rank, losses averaged over ranks ----
        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
        report = {"episodes": episodes, "ev": explained_var, "rng": rng_state(),
                  "times": {"rollout": rollout_time, "env": env_time, "update": update_time,
                            "allreduce": allreduce_time}}
        reports = [report]
        if distributed:
            reports = [None] * world_size
            dist.all_gather_object(reports, report)
        if master_process:
            pg_loss, v_loss, entropy, old_approx_kl, approx_kl, _ = flat_grads[n_params:].tolist()
            for step_at, ret, length in sorted(e for r in reports for e in r["episodes"]):
                writer.add_scalar("charts/episodic_return", ret, step_at)
                writer.add_scalar("charts/episodic_length", length, step_at)
                recent_returns.append(ret)
                num_episodes += 1
            sps = int(global_step / (elapsed_before + time.time() - start_time))
            writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            writer.add_scalar("losses/value_loss", v_loss, global_step)
            writer.add_scalar("losses/policy_loss", pg_loss, global_step)
            writer.add_scalar("losses/entropy", entropy, global_step)
            writer.add_scalar("losses/old_approx_kl", old_approx_kl, global_step)
            writer.add_scalar("losses/approx_kl", approx_kl, global_step)
            writer.add_scalar("losses/clipfrac", clipfrac_sum.item() / num_updates, global_step)
            writer.add_scalar("losses/explained_variance", np.nanmean([r["ev"] for r in reports]), global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            for r, rep in enumerate(reports):
                for key, seconds in rep["times"].items():
                    writer.add_scalar(f"perf/{key}_s/rank{r}", seconds, global_step)
            mean_return = f"{np.mean(recent_returns):.2f}" if recent_returns else "-"
            print(f"iter {iteration}/{args.num_iterations} | step {global_step} | SPS {sps} | "
                  f"return {mean_return} (last {len(recent_returns)} of {num_episodes} episodes)", flush=True)

        # ---- checkpoint: every --save-interval iterations, every --save-minutes, and at the end ----
        if master_process and (iteration == args.num_iterations
                               or (args.save_interval and iteration % args.save_interval == 0)
                               or (args.save_minutes and time.time() - last_save > 60 * args.save_minutes)):
            save_checkpoint({"model": agent.state_dict(), "optimizer": optimizer.state_dict(),
                             "iteration": iteration, "global_step": global_step, "args": vars(args),
                             "rng": [r["rng"] for r in reports], "world_size": world_size,
                             "elapsed": elapsed_before + time.time() - start_time}, ckpt_dir, args.keep_checkpoints)
            last_save = time.time()

    # Replicas must still agree: compare every rank's weights with rank 0's (one broadcast)
    replicas_identical = True
    if distributed:
        flat_params = torch.cat([p.detach().reshape(-1) for p in params])
        reference = flat_params.clone()
        dist.broadcast(reference, src=0)
        same = torch.tensor([float(torch.equal(flat_params, reference))], device=device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        replicas_identical = bool(same.item())
    for e in env_groups:
        e.close()
    if distributed:
        dist.destroy_process_group()  # evaluation below is rank 0's alone: no peer waits on it
    if master_process:
        elapsed = elapsed_before + time.time() - start_time
        mean_return = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
        print(f"done: {global_step} steps in {datetime.timedelta(seconds=int(elapsed))}, "
              f"SPS {int(global_step / elapsed)}, mean return (last {len(recent_returns)} episodes) "
              f"{mean_return}, {num_episodes} episodes, replicas identical: {replicas_identical}", flush=True)
        model_path = f"runs/{run_name}/{args.exp_name}.model"
        torch.save(agent.state_dict(), model_path)
        if args.eval_episodes > 0:
            returns = evaluate(agent, args.env_id, args.eval_episodes, device, args.capture_video, run_name,
                               args.seed)
            for idx, episodic_return in enumerate(returns):
                writer.add_scalar("eval/episodic_return", episodic_return, idx)
            print(f"eval {model_path}: {len(returns)} episodes, return {np.mean(returns):.2f} "
                  f"+- {np.std(returns):.2f}", flush=True)
        writer.close()
        if args.track:
            wandb.finish()
    if distributed:
        # Leave without interpreter finalization: gloo's C++ threads can abort it (SIGABRT,
        # "terminate called without an active exception") even after destroy_process_group.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if replicas_identical else 1)
    if not replicas_identical:
        sys.exit(1)
