# Data-parallel PPO for Atari, in one file.
#   python ppo_atari_multigpu.py                                    # one process
#   torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py  # 2 ranks on this machine
# Every rank steps its own envs and computes gradients on its own samples; before each optimizer
# step ONE flat buffer holding all gradients is all-reduced and averaged, so every replica takes
# the same step and the weights stay bit-identical across ranks.
#
# Layout: the CORE is CleanRL's PPO in CleanRL's order (Args, make_env, Agent, GAE, loss, the
# flat-gradient all-reduce); the EXTRAS follow, one labelled block each; MAIN shows the loop.
# Common edits are one local change each (README "Changing the file"): the encoder (nature_cnn),
# --frame-stack, a loss term (ppo_loss and LOSS_STATS), a flag (Args), a schedule (MAIN).
import atexit
import contextlib
import ctypes
import datetime
import difflib
import errno
import fcntl
import glob
import hashlib
import json
import math
import os
import pickle
import pickletools
import random
import resource
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
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
from ale_py.vector_env import AtariVectorEnv
from torch.distributions.categorical import Categorical
from torch.utils.tensorboard import SummaryWriter

gym.register_envs(ale_py)


# ================================================================================================
# CORE: CleanRL's PPO
# ================================================================================================
@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (env i of rank r gets seed + the envs of ranks < r + i)"""
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
    """whether to capture videos of the agent (rank 0, env 0) to `videos/<run_name>`"""

    # Algorithm specific arguments
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    frame_stack: int = 4
    """the number of most recent frames the agent sees (both env backends)"""
    total_timesteps: int = 10000000
    """total timesteps of the experiments (all ranks together)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: Optional[int] = None
    """the number of parallel game environments per rank (default 8)"""
    num_steps: Optional[int] = None
    """the number of steps to run in each environment per policy rollout (default 128)"""
    anneal_lr: bool = True
    """Toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: Optional[int] = None
    """the number of mini-batches (default 4)"""
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

    # Batch sizes: give any consistent subset (README "How local and global sizes derive")
    num_envs: Optional[int] = None
    """the number of parallel game environments of all ranks (= local_num_envs * world size)"""
    local_batch_size: Optional[int] = None
    """samples per rank per rollout (= local_num_envs * num_steps)"""
    local_minibatch_size: Optional[int] = None
    """samples per rank per minibatch (= local_batch_size / num_minibatches)"""
    grad_accum: int = 1
    """split each local minibatch into this many micro-batches (less memory, same gradient)"""
    rank_envs: Optional[list[int]] = None
    """envs of each rank, e.g. `--rank-envs 6 2` for uneven nodes (default: the same on all)"""
    balance_envs: bool = False
    """move envs from slow ranks to fast ones as they train (README "Uneven ranks")"""

    # Distributed (README "Launching")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """collective backend; auto = nccl when every rank has its own GPU, else gloo"""
    device_ids: Optional[list[int]] = None
    """GPU of each rank, e.g. `--device-ids 0 0 1 1` (one id per rank; default: local rank)"""
    threads: Optional[int] = None
    """torch CPU threads per rank (default: cores // ranks on this node, at least 1)"""
    bucket_mb: float = 1.0
    """all-reduce the gradients in buckets of about this many MB as backward finishes them
    (0: one all-reduce after backward)"""
    allreduce_fp16: bool = False
    """all-reduce the gradients as fp16: half the bytes on the wire, rounded (opt-in)"""
    pg_timeout: float = 600.0
    """seconds a collective may wait for a peer before the run fails"""

    # Progress (README "Watching a run")
    print_every: float = 10.0
    """seconds between progress lines (the first and last iteration always print; 0: each)"""

    # Checkpoints, resume and evaluation (README "Long runs and failures")
    run_name: Optional[str] = None
    """the run's directory under runs/ (default: {env_id}__{exp_name}__{seed}__{timestamp})"""
    save_interval: int = 50
    """save a checkpoint every this many iterations, and always at the end (0: only at the end)"""
    save_minutes: float = 0.0
    """also save when this many minutes have passed since the last checkpoint (0: off)"""
    keep_checkpoints: int = 3
    """how many of the latest checkpoints to keep in runs/<run_name>/checkpoints"""
    resume: Optional[str] = None
    """`auto`: continue this run's latest checkpoint (or start fresh); or a checkpoint path"""
    eval_episodes: int = 10
    """full games played by the final model, logged as eval/episodic_return (0: skip)"""
    eval_checkpoint: Optional[str] = None
    """evaluation only: play --eval-episodes games with this model or checkpoint, print returns"""

    # Speed (README "Performance"): the defaults keep CleanRL's math
    channels_last: bool = True
    """keep conv weights channels-last: faster oneDNN/cuDNN kernels, same math (other rounding)"""
    amp: Literal["none", "bf16", "fp16"] = "none"
    """autocast precision for rollout and update (fp16 adds a GradScaler); changes the numbers"""
    compile: bool = False
    """torch.compile the policy step and the loss's forward and backward (opt-in: rounding)"""
    cuda_graphs: bool = False
    """with --compile on CUDA: replay the compiled step as CUDA graphs (fewer kernel launches)"""
    env_backend: Literal["sync", "native"] = "sync"
    """sync: gymnasium SyncVectorEnv in this process; native: ale-py's C++ AtariVectorEnv"""
    async_envs: bool = False
    """two env groups: one steps (threads or subprocesses) while the policy acts for the other"""

    # Filled in at run time from the flags above; not flags themselves
    world_size: tyro.conf.Suppress[int] = 1
    """the number of ranks"""
    batch_size: tyro.conf.Suppress[int] = 0
    """the batch size of all ranks"""
    minibatch_size: tyro.conf.Suppress[int] = 0
    """the mini-batch size of all ranks"""
    num_iterations: tyro.conf.Suppress[int] = 0
    """the number of iterations"""


# What a resume may change: world size and layout, backend, threads, precision, compile, env
# backend, saving, logging, evaluation, the total. Every other field of Args is the run's identity:
# it names a `--resume auto` run and a resume must keep it, so a new field joins it without a word.
RESUMABLE = tuple(
    """world_size local_num_envs local_batch_size local_minibatch_size grad_accum rank_envs
    balance_envs backend device_ids cuda torch_deterministic threads bucket_mb allreduce_fp16
    pg_timeout channels_last amp compile cuda_graphs env_backend async_envs run_name resume
    save_interval save_minutes keep_checkpoints print_every track wandb_project_name wandb_entity
    capture_video eval_episodes eval_checkpoint total_timesteps num_iterations""".split()
)


def flag(name):
    return "--" + name.replace("_", "-")


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
        if not self.game_over and not seeded:  # a life was lost: go on in the same game
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


def make_env(env_id, idx, capture_video, run_name, frame_stack):
    def thunk():
        # v5 ids skip frames in the emulator: skip them once, below. Grayscale: AtariPreprocessing
        # reads the emulator's screen itself, and the env's own frame is cheaper than RGB
        kwargs = {"frameskip": 1} if gym.spec(env_id).kwargs.get("frameskip", 1) != 1 else {}
        kwargs["obs_type"] = "grayscale"
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array", **kwargs)
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id, **kwargs)
        env = gym.wrappers.RecordEpisodeStatistics(env)  # innermost: the real game's score
        env = gym.wrappers.AtariPreprocessing(
            env, noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False
        )
        env = EpisodicLife(env)
        if env.unwrapped.get_action_meanings()[1] == "FIRE":
            env = FireReset(env)
        env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))
        env = gym.wrappers.FrameStackObservation(env, frame_stack)
        return env

    return thunk


def env_seeds(seed, rank, local_num_envs, rank_envs=None):
    """Distinct seeds over all ranks' envs (CleanRL's multi-GPU script overlaps them)."""
    first = sum(rank_envs[:rank]) if rank_envs else rank * local_num_envs
    return [seed + first + i for i in range(local_num_envs)]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def output_size(module, obs_shape):
    """Features `module` makes of one observation: sizes come from the data, not from literals.
    In eval mode: a BatchNorm takes batch 1 and its running statistics stay untouched."""
    training = module.training
    with torch.no_grad():
        size = module.eval()(torch.zeros(1, *obs_shape)).shape[1]
    module.train(training)
    return size


def nature_cnn(obs_shape):
    """The encoder: frames (C, H, W) scaled to [0, 1] in, features out. Any nn.Module that does
    this fits (README "Changing the file"); the fast path finds its layers by role."""
    convs = nn.Sequential(
        layer_init(nn.Conv2d(obs_shape[0], 32, 8, stride=4)),
        nn.ReLU(),
        layer_init(nn.Conv2d(32, 64, 4, stride=2)),
        nn.ReLU(),
        layer_init(nn.Conv2d(64, 64, 3, stride=1)),
        nn.ReLU(),
        nn.Flatten(),
    )
    fc = layer_init(nn.Linear(output_size(convs, obs_shape), 512))
    return nn.Sequential(*convs, fc, nn.ReLU())


class Agent(nn.Module):
    def __init__(self, obs_shape, num_actions):
        super().__init__()
        self.network = nature_cnn(obs_shape)
        width = output_size(self.network, obs_shape)
        self.actor = layer_init(nn.Linear(width, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(width, 1), std=1)

    def features(self, x):
        # x / 255.0, in the first layer's layout and dtype (FAST PATH: network_input)
        return self.network(network_input(x, next(self.network.parameters()))).float()

    def get_value(self, x):
        features = self.features(x)
        with torch.autocast(x.device.type, enabled=False):  # heads in fp32 even under --amp
            return self.critic(features)

    def get_action_and_value(self, x, action=None):
        features = self.features(x)
        # fp32 heads even under --amp: PPO's ratio exp(new - old log-prob) needs more than bf16's
        # 8 mantissa bits. No validation: a NaN must reach the non-finite check, not raise here.
        with torch.autocast(x.device.type, enabled=False):
            probs = Categorical(logits=self.actor(features), validate_args=False)
            if action is None:
                action = probs.sample()
            out = dict(action=action, logprob=probs.log_prob(action), entropy=probs.entropy())
            return out | dict(value=self.critic(features))  # by name: a new head, one more entry


def start_rollouts(envs, args, seed, rank, device):
    """Fresh games (seeds distinct over ranks) and empty rollout buffers of their size. Frames
    stay uint8: a float copy would be 4x the memory."""
    shape = (args.num_steps, args.local_num_envs)
    obs = frame_buffer(shape + envs.single_observation_space.shape, args.channels_last, device)
    actions = torch.zeros(shape, dtype=torch.long, device=device)
    logprobs, rewards, dones, values, bootstraps = torch.zeros((5, *shape), device=device)
    seeds = env_seeds(seed, rank, args.local_num_envs, args.rank_envs)
    next_obs = upload(envs.reset(seeds), device)
    next_done = torch.zeros(args.local_num_envs, device=device)
    return (obs, actions, logprobs, rewards, dones, values, bootstraps), next_obs, next_done


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """dones[t] = 1 means obs[t] starts a new episode, so the return from t-1 stops there. In
    numpy on the host: on CUDA ~6 tiny kernels a step cost more (same numbers, tested)."""
    device, values_on_device = rewards.device, values
    host = (x.cpu().numpy() for x in (rewards, values, dones, next_value, next_done))
    rewards, values, dones, next_value, next_done = host
    advantages = np.zeros_like(rewards)
    lastgaelam = 0
    num_steps = rewards.shape[0]
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal, nextvalues = 1.0 - next_done, next_value
        else:
            nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    advantages = torch.from_numpy(advantages).to(device)
    return advantages, advantages + values_on_device


def normalize_advantages(adv, world_size):
    # Statistics of the GLOBAL minibatch (the union over ranks), not of the local one: then the
    # rank-averaged gradient equals the single-process gradient on that union exactly.
    s = torch.stack([adv.sum(), (adv * adv).sum(), adv.new_tensor(adv.numel())]).double()
    if world_size > 1:
        collective(dist.all_reduce, s)
    n = s[2]  # the global minibatch's size (with --rank-envs ranks differ)
    mean = s[0] / n
    std = ((s[1] - n * mean * mean) / (n - 1)).clamp(min=0).sqrt()
    return (adv - mean.float()) / (std.float() + 1e-8)


# The loss statistics (TensorBoard tags losses/<name>), carried at the end of the flat gradient
# buffer. Each must be a per-sample MEAN over the (micro-)batch: weighted by its share and summed
# over micro-batches and ranks, it is the global minibatch's mean. Add one here and in ppo_loss.
LOSS_STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")


def loss_coefficients(args: Args, device):
    """ppo_loss's coefficients as 0-d tensors: a schedule changes one in place (one line in MAIN)
    and --compile reads them as inputs, not as constants baked into its graph (no recompile)."""
    names = ("clip_coef", "ent_coef", "vf_coef")
    return {name: torch.tensor(float(getattr(args, name)), device=device) for name in names}


def ppo_loss(agent, args, coef, mb):
    """The clipped PPO loss of one (micro-)batch (a dict: MAIN's `batch`), and its LOSS_STATS as
    one small tensor."""
    new = agent.get_action_and_value(mb["obs"], mb["actions"])
    advantages, returns, values = mb["advantages"], mb["returns"], mb["values"]
    logratio = new["logprob"] - mb["logprobs"]
    ratio = logratio.exp()
    stats = {}
    with torch.no_grad():
        stats["old_approx_kl"] = (-logratio).mean()
        stats["approx_kl"] = ((ratio - 1) - logratio).mean()
        stats["clipfrac"] = ((ratio - 1.0).abs() > coef["clip_coef"]).float().mean()
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - coef["clip_coef"], 1 + coef["clip_coef"])
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
    newvalue = new["value"].view(-1)
    if args.clip_vloss:
        v_loss_unclipped = (newvalue - returns) ** 2
        v_clipped = values + torch.clamp(newvalue - values, -coef["clip_coef"], coef["clip_coef"])
        v_loss_clipped = (v_clipped - returns) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
    entropy_loss = new["entropy"].mean()
    loss = pg_loss - coef["ent_coef"] * entropy_loss + v_loss * coef["vf_coef"]
    stats.update(policy_loss=pg_loss, value_loss=v_loss, entropy=entropy_loss)
    return loss, torch.stack([stats[name] for name in LOSS_STATS]).detach()


# ---- the flat gradient buffer: ONE buffer, all-reduced in buckets as backward fills it ----
# Invariants (checked each iteration by grads_in_buffer):
# - make the buffer AFTER every .to() / memory-format change of the model: the views copy each
#   parameter's strides (e.g. channels-last), and a move would leave them behind;
# - never optimizer.zero_grad(): it sets .grad to None and drops the views; zero the buffer;
# - load a state dict IN PLACE (load_state_dict), never by replacing the parameters;
# - GradBuckets cuts buckets from the end: backward should finish the last parameters first (a
#   trunk and its heads do); otherwise a bucket starts later, never early: it waits for all its own.
def flat_grad_buffer(params, extra):
    """One buffer for all gradients (each .grad a view into it) plus `extra` slots at the end for
    statistics, all-reduced together (GradBuckets): no cat, no copy-back."""
    flat = torch.zeros(sum(p.numel() for p in params) + extra, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat.as_strided(p.shape, p.stride(), offset)
        offset += p.numel()
    return flat


def grads_in_buffer(params, flat):
    """True while every .grad is still the view flat_grad_buffer made (cheap: pointers only)."""
    offset = 0
    for p in params:
        expected = flat.data_ptr() + offset * flat.element_size()
        if p.grad is None or p.grad.data_ptr() != expected or p.grad.stride() != p.stride():
            return False
        offset += p.numel()
    return True


def collective(fn, tensor, **kwargs):
    """fn(tensor) in place, through a host copy where gloo would get a CUDA tensor (ranks sharing
    a GPU): PyTorch no longer tests gloo on CUDA tensors."""
    if not (tensor.is_cuda and dist.get_backend() == "gloo"):
        return fn(tensor, **kwargs)
    host = tensor.cpu()
    fn(host, **kwargs)
    tensor.copy_(host)


class GradBuckets:
    """The flat buffer's all-reduce overlapped with backward: views cut in the order backward
    finishes them (heads first), each launched async once its gradients are final, in the same
    order on every rank; the LOSS_STATS ride in the first. fp16: gradients travel averaged, as
    fp16. host: through (pinned) host copies, as `collective`. `clock` times the waits."""

    def __init__(self, params, flat, bucket_mb, world_size, fp16=False, host=None, clock=None):
        self.flat, self.world_size, self.final = flat, world_size, False
        self.stats = flat[sum(p.numel() for p in params) :]  # LOSS_STATS, all-reduced too
        self.clock = clock or contextlib.nullcontext()
        self.views, self.grads_in, self.bucket_of = [], [], {}
        cap = bucket_mb * 2**20 / flat.element_size() if bucket_mb > 0 else math.inf
        starts = np.cumsum([0] + [p.numel() for p in params])
        end, count = flat.numel(), 0
        if fp16:  # the statistics in a bucket of their own, ready at once, sent as fp32
            self.views.append(self.stats)
            self.grads_in.append(0)
            end = starts[-1]
        for i in reversed(range(len(params))):
            self.bucket_of[params[i]], count = len(self.views), count + 1
            if i == 0 or end - starts[i] >= cap:
                self.views.append(flat[starts[i] : end])
                self.grads_in.append(count)
                end, count = starts[i], 0
        if host is None:
            host = flat.is_cuda and world_size > 1 and dist.get_backend() == "gloo"
        self.as_fp16 = [fp16 and n > 0 for n in self.grads_in]
        self.sent = []  # what travels for each bucket: the view itself or a copy of it
        for view, as_fp16 in zip(self.views, self.as_fp16):
            dtype = torch.half if as_fp16 else view.dtype
            if host:
                self.sent.append(torch.empty(view.shape, dtype=dtype, pin_memory=flat.is_cuda))
            else:
                self.sent.append(view if dtype == view.dtype else view.half())
        if world_size > 1 and len(self.views) > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self.grad_ready)

    def expect_final_grads(self):  # before the backward that leaves them (last micro-batch)
        self.missing, self.works, self.final = list(self.grads_in), [], True

    def grad_ready(self, p):  # p.grad is final for this minibatch
        if self.final:
            self.missing[self.bucket_of[p]] -= 1
            self.launch()

    def launch(self, everything=False):  # the next buckets in order, while they are complete
        while (k := len(self.works)) < len(self.views) and (everything or self.missing[k] == 0):
            view, sent = self.views[k], self.sent[k]
            if self.as_fp16[k]:
                view.div_(self.world_size)  # averaged before the cast: fp16's range holds
            if sent is not view:
                sent.copy_(view)  # to the host: a blocking copy, so gloo reads the final bytes
            self.works.append(dist.all_reduce(sent, async_op=True))

    def wait(self):  # after backward: launch what is left, wait for all, average
        self.final = False
        if self.world_size == 1:
            return
        with self.clock:  # what backward did not hide
            self.launch(everything=True)
            for work, view, sent, as_fp16 in zip(self.works, self.views, self.sent, self.as_fp16):
                work.wait()
                if sent is not view:
                    view.copy_(sent)
                if not as_fp16:
                    view /= self.world_size  # SUM, then divide: gloo has no AVG


def minibatch_gradient(agent, args, coef, batch, mb_inds, buckets, autocast, scaler):
    """Loss and backward of one minibatch (`mb_inds`, indices on the batch's device): after
    buckets.wait() buckets.flat holds its gradient averaged over ranks, then its LOSS_STATS.
    A rank's loss counts by its share of the global minibatch: the average is the gradient on
    the union, even with --rank-envs. --grad-accum K: K micro-batch means / K, a backward each."""
    mb_advantages = batch["advantages"][mb_inds]
    if args.norm_adv:
        with buckets.clock:  # its tiny all-reduce is where ranks wait for a slower rollout
            mb_advantages = normalize_advantages(mb_advantages, args.world_size)
    buckets.flat.zero_()  # never optimizer.zero_grad(): the .grads are views of this buffer
    # this rank's share of the global minibatch x world size: exactly 1.0 when ranks are even
    share = len(mb_inds) * args.world_size / args.minibatch_size if args.world_size > 1 else 1.0
    micro = len(mb_inds) // args.grad_accum
    loss_fn = getattr(agent, "compiled_loss", ppo_loss)  # --compile: speed_up compiled it
    for m in range(0, len(mb_inds), micro):
        i = mb_inds[m : m + micro]
        mb = {k: gather_frames(v, i) if k == "obs" else v[i] for k, v in batch.items()}
        mb["advantages"] = mb_advantages[m : m + micro]  # normalized over the global minibatch
        with autocast:
            loss, stats = loss_fn(agent, args, coef, mb)
        buckets.stats.add_(stats * share / args.grad_accum)
        if m + micro == len(mb_inds):
            buckets.expect_final_grads()  # only the last backward launches all-reduces
        scaler.scale(loss * share / args.grad_accum).backward()


# ================================================================================================
# EXTRAS: one block each; MAIN calls each in a line or two
# ================================================================================================


# ---- FLAGS: derived sizes and the checks that need no process group ---------------------------
PER_RANK = ("local_num_envs", "local_batch_size", "local_minibatch_size")  # --rank-envs: own
LAUNCH_ONLY = ("backend", "pg_timeout", "bucket_mb", "allreduce_fp16", "balance_envs")


def resolve_sizes(args: Args, world_size: int, rank: int = 0) -> Args:
    """Derive all batch sizes (local ones: `rank`'s) from those given; refuse inconsistent ones."""

    def need(ok, msg):
        if not ok:
            raise ValueError(msg)

    counts = "local_num_envs num_envs num_steps local_batch_size local_minibatch_size frame_stack"
    for name in (counts + " num_minibatches grad_accum total_timesteps update_epochs").split():
        value = getattr(args, name)
        need(value is None or value >= 1, f"{flag(name)} must be >= 1, got {value}")
    split = args.rank_envs
    if split is not None:  # uneven ranks: own env counts, the same number of minibatches
        given = [flag(n) for n in PER_RANK if getattr(args, n) is not None]
        need(not given, f"--rank-envs gives every rank's sizes: drop {' '.join(given)}")
        msg = f"--rank-envs {' '.join(map(str, split))}"
        need(len(split) == world_size, f"{msg}: one count per rank, world size {world_size}")
        need(min(split) >= 1, f"{msg}: every rank needs at least 1 env")
        need(args.num_envs in (None, sum(split)), f"{msg} sum != --num-envs {args.num_envs}")
        steps, n_mb, k = args.num_steps or 128, args.num_minibatches or 4, args.grad_accum
        for r, envs in enumerate(split):
            msg = f"--num-minibatches {n_mb} x --grad-accum {k} does not divide rank {r}'s batch"
            need(envs * steps % (n_mb * k) == 0, f"{msg} ({envs} envs x {steps} steps)")
        args.local_num_envs, args.num_steps, args.num_minibatches = split[rank], steps, n_mb
    envs, steps, lbs, n = args.local_num_envs, args.num_steps, args.local_batch_size, args.num_envs
    if n is not None and split is None:
        need(n % world_size == 0, f"--num-envs {n} is not divisible by the world size {world_size}")
        msg = f"--num-envs {n} != --local-num-envs {envs} x world size {world_size}"
        need(envs is None or envs * world_size == n, msg)
        envs = n // world_size
    if envs is None:
        envs = lbs // steps if lbs is not None and steps is not None else 8
    if steps is None:
        msg = f"--local-batch-size {lbs} is not divisible by --local-num-envs {envs}"
        need(lbs is None or lbs % envs == 0, msg)
        steps = lbs // envs if lbs is not None else 128
    msg = f"--local-batch-size {lbs} != --local-num-envs {envs} x --num-steps {steps}"
    need(lbs is None or lbs == envs * steps, msg)
    lbs = envs * steps
    mbs, n_mb = args.local_minibatch_size, args.num_minibatches
    if mbs is None:
        n_mb = n_mb or 4
        need(lbs % n_mb == 0, f"--num-minibatches {n_mb} does not divide --local-batch-size {lbs}")
    else:
        msg = f"--local-minibatch-size {mbs} does not divide --local-batch-size {lbs}"
        need(lbs % mbs == 0, msg)
        msg = f"--num-minibatches {n_mb} x --local-minibatch-size {mbs} != --local-batch-size {lbs}"
        need(n_mb in (None, lbs // mbs), msg)
        n_mb = lbs // mbs
    mbs, k = lbs // n_mb, args.grad_accum
    need(mbs % k == 0, f"--grad-accum {k} does not divide --local-minibatch-size {mbs}")
    total = sum(split) if split else envs * world_size
    msg = f"--total-timesteps {args.total_timesteps} is less than one rollout of all ranks"
    need(args.total_timesteps >= total * steps, f"{msg} ({total * steps} = {total} envs x {steps})")
    if args.balance_envs and world_size > 1 and split is None:  # the even split to start from
        args.rank_envs = [envs] * world_size
    args.local_num_envs, args.num_envs, args.num_steps = envs, total, steps
    args.local_batch_size, args.local_minibatch_size, args.num_minibatches = lbs, mbs, n_mb
    args.world_size, args.batch_size = world_size, total * steps
    args.minibatch_size = total * steps // n_mb
    args.num_iterations = args.total_timesteps // args.batch_size
    return args


def check_env_id(env_id: str):
    if env_id not in gym.registry:
        close = difflib.get_close_matches(env_id, list(gym.registry.keys()), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown env id {env_id!r}{hint}")
    if not str(gym.spec(env_id).entry_point).startswith("ale_py"):
        raise ValueError(f"env id {env_id!r} is not an Atari (ale-py) environment")


def check_args(args: Args, world_size: int, rank: int = 0):
    """Resolve sizes, refuse bad input alike on every rank; return warnings for idle flags."""
    resolve_sizes(args, world_size, rank)
    check_env_id(args.env_id)
    if args.async_envs and min(args.rank_envs or [args.local_num_envs]) < 2:
        msg = "--async-envs splits each rank's envs into two groups: needs >= 2 on every rank"
        raise ValueError(f"{msg}, got {args.rank_envs or args.local_num_envs}")
    if args.capture_video and args.env_backend == "native":
        raise ValueError("--capture-video records through gymnasium: use --env-backend sync")
    cxx = os.environ.get("CXX", "g++")  # inductor builds its CPU kernels (and Triton's) with it
    if args.compile and not shutil.which(cxx):
        raise ValueError(f"--compile needs a C++ compiler: {cxx} is not on PATH (install g++)")
    if args.compile and not torch._dynamo.is_dynamo_supported():
        raise ValueError(f"--compile: torch {torch.__version__} cannot compile on this Python")
    if args.cuda_graphs and not (args.compile and args.cuda and torch.cuda.is_available()):
        raise ValueError("--cuda-graphs replays the compiled step on a GPU: needs --compile, CUDA")
    if args.eval_checkpoint and args.eval_episodes < 1:
        raise ValueError(f"--eval-checkpoint needs --eval-episodes >= 1, got {args.eval_episodes}")
    # every other numeric flag's range (the sizes are resolve_sizes'); NaN and inf fail each test
    for need, ok, names in (
        ("in [0, 1]", lambda v: 0 <= v <= 1, "gamma gae_lambda"),
        ("> 0", lambda v: 0 < v < math.inf, "learning_rate clip_coef vf_coef max_grad_norm"),
        ("> 0", lambda v: 0 < v < math.inf, "target_kl pg_timeout"),
        (">= 0", lambda v: 0 <= v < math.inf, "ent_coef save_interval save_minutes eval_episodes"),
        (">= 0", lambda v: 0 <= v < math.inf, "print_every bucket_mb"),
        (">= 1", lambda v: v >= 1, "keep_checkpoints threads"),
        ("in [0, 2**31)", lambda v: 0 <= v < 2**31, "seed"),  # + rank: numpy takes < 2**32
    ):
        for name in names.split():
            value = getattr(args, name)
            if value is not None and not ok(value):
                raise ValueError(f"{flag(name)} must be {need}, got {value}")
    idle = [("device_ids", "with --no-cuda")] if not args.cuda else []
    if world_size == 1:
        idle += [(name, "in a single process") for name in LAUNCH_ONLY]
    if not args.track:
        idle += [("wandb_project_name", "without --track"), ("wandb_entity", "without --track")]
    given = [(name, why) for name, why in idle if getattr(args, name) != getattr(Args, name)]
    return [f"warning: {flag(name)} has no effect {why}" for name, why in given]


def check_launch(env):
    """Refuse launches that would silently run N independent copies or half a process group."""
    if "RANK" in env:
        return
    if int(env.get("WORLD_SIZE", 1)) > 1:
        also = "or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for every process"
        unset = f"WORLD_SIZE={env['WORLD_SIZE']} is set but RANK is not"
        raise ValueError(f"{unset}: launch with torchrun ({also})")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        # srun's tasks have a SLURM_STEP_ID; a batch script's own python does not (it is one)
        if int(env.get(var, 1)) > 1 and (var != "SLURM_NTASKS" or "SLURM_STEP_ID" in env):
            how = "torchrun (one per node), e.g. `srun torchrun --nnodes=$SLURM_NNODES ...`"
            alone = "without torchrun's RANK: every process would train alone. Launch with"
            raise ValueError(f"started by an MPI launcher ({var}={env[var]}) {alone} {how}")


# ---- LAUNCH: device and backend, process group, the same flags on every rank -----------------
def choose_device(args: Args, rank, local_rank, world_size, local_world_size, num_gpus):
    """This rank's device (LOCAL_RANK's GPU, or --device-ids[RANK]) and collective backend, from
    flags and launch layout only: every rank reaches the same verdict, or the same ValueError."""
    ids = args.device_ids
    if ids is not None and len(ids) != world_size:
        raise ValueError(f"--device-ids has {len(ids)} ids for world size {world_size}")
    use_cuda = args.cuda and num_gpus > 0
    gpu, shared_gpu = None, False
    if use_cuda and ids is not None:
        if max(ids) >= num_gpus:
            raise ValueError(f"--device-ids {ids} names a GPU this node lacks ({num_gpus} GPUs)")
        # ranks r // local_world_size share a node; nccl refuses two ranks on one GPU of a node
        nodes = [ids[i : i + local_world_size] for i in range(0, world_size, local_world_size)]
        gpu, shared_gpu = ids[rank], any(len(set(node)) < len(node) for node in nodes)
    elif use_cuda:
        gpu, shared_gpu = local_rank % num_gpus, local_world_size > num_gpus
    auto = "nccl" if use_cuda and not shared_gpu else "gloo"
    backend = auto if args.backend == "auto" else args.backend
    if backend == "nccl" and not use_cuda:
        why = "this rank has no GPU (or --no-cuda was given)"
        raise ValueError(f"--backend nccl needs CUDA, but {why}; use --backend gloo")
    if backend == "nccl" and shared_gpu:
        layout = f"{local_world_size} ranks per node, {num_gpus} GPUs, --device-ids {ids}"
        raise ValueError(f"nccl refuses two ranks on one GPU ({layout}); use --backend gloo")
    return torch.device("cuda" if use_cuda else "cpu", gpu), backend


def thread_counts(args: Args, device, local_world_size):
    """(torch threads, ale-py threads per env group) from this node's cores per rank, not torchrun's
    OMP_NUM_THREADS=1. On CUDA torch gets 1 thread, the emulators the rest (at most 1 per env)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = max(1, (cores or 1) // local_world_size)
    if device.type != "cuda":
        return args.threads or cores, args.threads or cores
    torch_threads, groups = args.threads or 1, 2 if args.async_envs else 1
    env_cores = max(1, cores - torch_threads) // groups
    return torch_threads, max(1, min(env_cores, args.local_num_envs // groups))


def init_distributed(backend, rank, world_size, pg_timeout):
    timeout = datetime.timedelta(seconds=pg_timeout)
    # torchrun's store outlives --max-restarts: a per-attempt prefix hides replaced ranks' keys
    is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    tcp_store = dist.TCPStore(addr, port, world_size, is_master=is_master, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt_{attempt}", tcp_store)
    # the global RANK (not LOCAL_RANK) names this process in the group: right on many nodes
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    # a second client for the failure board's watcher thread, beside the group's own
    client = dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"attempt_{attempt}/failures", client)


def broadcast_object(obj, distributed, src=0):
    """Rank src's `obj` (anything picklable) on every rank."""
    box = [obj]
    if distributed:
        dist.broadcast_object_list(box, src=src)
    return box[0]


def check_same_flags(args: Args, rank, world_size):
    """Refuse ranks launched with different flags: they would run different collectives and hang."""
    own = ("threads", *(PER_RANK if args.rank_envs else ()))  # may differ per node or rank
    mine = {k: v for k, v in vars(args).items() if k not in own}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    differ = []
    for key, value in everyone[0].items():
        values = [flags.get(key) for flags in everyone]
        if any(v != value for v in values):
            each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            differ.append(f"{flag(key)} ({each})")
    if differ:
        fail(f"ranks were launched with different flags: {'; '.join(differ)}", rank, world_size)


# ---- FAILURES: one line naming the rank and the cause, peers stopped at once -----------------
def leave(code, distributed):
    """Exit after flushing logs; ranks use os._exit: gloo's threads can SIGABRT the finalization."""
    if not distributed:
        sys.exit(code)
    atexit._run_exitfuncs()  # e.g. the TensorBoard writer's close
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def one_line(exc, limit):
    return " ".join(str(exc).split())[:limit]


def warn(msg):
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def fail(msg, rank, world_size, code=2):
    """One line naming the rank, then exit `code`: for errors every rank detects alike."""
    where = f" [rank {rank}]" if world_size > 1 else ""
    WHERE["phase"] = "exit"  # the FailureBoard's watcher: this rank leaves on purpose
    print(f"error{where}: {msg}", file=sys.stderr, flush=True)
    if world_size > 1 and not dist.is_initialized():
        time.sleep(2)  # the peers check the same input: each prints before torchrun stops them
    leave(code, world_size > 1)


class CrashReport:
    """sys.excepthook: the traceback, then one line naming the rank and cause (OOM advice; for a
    failed collective, the silent peers); with a FailureBoard it is posted and the peers stop."""

    def __init__(self, rank, pg_timeout):
        self.rank, self.pg_timeout, self.device, self.board = rank, pg_timeout, None, None

    def __call__(self, exc_type, exc, tb):
        sys.__excepthook__(exc_type, exc, tb)
        first = (str(exc).strip().splitlines() or [exc_type.__name__])[0][:300]
        msg = oom_advice(exc, self.device) or f"{exc_type.__name__}: {first}"
        peer_words = ("Timed out", "timed out", "closed by peer", "Connection reset", "remote")
        collective = isinstance(exc, RuntimeError) and any(k in first for k in peer_words)
        if collective and dist.is_initialized():
            who = "; ".join(self.board.silent_peers().values()) if self.board else ""
            who = who or "a peer rank died or stopped responding"
            timeout = f"--pg-timeout {self.pg_timeout:g}s"
            msg = f"{exc_type.__name__}: a collective failed: {who} ({timeout}) [{first}]"
        if posted := self.board and self.board.posted():  # a peer failed first: that is why
            msg = f"stopping, {posted}"
        print(f"error [rank {self.rank}]: {msg}", file=sys.stderr, flush=True)
        if self.board is not None:
            self.board.post(msg)
            leave(1, True)


def oom_advice(exc, device):
    """One line for an out-of-memory error (else None): what was in use, the flags that lower it."""
    oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
    if not oom and "can't allocate memory" not in str(exc):  # torch's CPU allocator
        return None
    used = f"{host_rss_gb():.1f} GiB host RSS"
    if device is not None and device.type == "cuda":
        used += f", {torch.cuda.memory_reserved(device) / 2**30:.1f} GiB GPU reserved"
    less = "--grad-accum K (micro-batches), fewer --local-num-envs, or a shorter --num-steps"
    return f"out of memory ({type(exc).__name__}: {one_line(exc, 120)}; {used}): use {less}"


WHERE = {"phase": "setup", "iteration": 0}  # MAIN's stage: what the FailureBoard publishes


class FailureBoard:
    """A watcher thread beats host, pid and WHERE into the launcher's store each second until the
    process ends (a peer may wait on our slow save); a posted failure, a dead peer, or one silent
    min(--pg-timeout / 2, 60) s (10 s if stopped here) stops us: named before a collective fails."""

    def __init__(self, store, rank, world_size, pg_timeout, orphaned):
        self.store, self.rank, self.world_size, self.orphaned = store, rank, world_size, orphaned
        self.stale_after, self.parent, self.seen = min(pg_timeout / 2, 60.0), os.getppid(), {}
        # containers on one host (host network) share its name, not their pid namespaces
        ns = os.readlink("/proc/self/ns/pid") if os.path.islink("/proc/self/ns/pid") else ""
        self.me, self.beat, self.store_alive = [socket.gethostname(), os.getpid(), ns], 0, True
        threading.Thread(target=self.watch, daemon=True).start()

    def call(self, fn, *args):
        """fn(*args) on the store; None once it failed (torch would warn at every further call)."""
        try:
            return fn(*args) if self.store_alive else None
        except Exception:
            self.store_alive = False

    def post(self, line):
        self.call(self.store.set, "failed", f"rank {self.rank}: {line}")

    def posted(self):
        """Another rank's failure line, if one was posted (None if none, or the store is gone)."""
        line = self.call(lambda: self.store.check(["failed"]) and self.store.get("failed").decode())
        return None if not line or line.startswith(f"rank {self.rank}:") else line

    def silent_peers(self):
        """{rank: line} for each peer that died without a word or stopped beating: where it was."""
        lines, now = {}, time.time()
        for r, ((host, pid, ns, phase, iteration, _), since) in sorted(self.seen.items()):
            if phase == "exit":  # it left on purpose (fail, or after a preemption's save)
                continue
            who = f"rank {r} ({host}, pid {pid})"
            where = f"in the {phase} of iteration {iteration}" if iteration else f"in {phase}"
            state = proc_state(pid) if [host, ns] == self.me[::2] else "?"  # "?": not ours
            if state in (None, "Z", "X"):
                why = "killed by a signal? (on Linux the OOM killer is the usual cause: see dmesg)"
                lines[r] = f"{who} died without a word {where}: {why}"
            elif self.store_alive and now - since > (10 if state in "Tt" else self.stale_after):
                lines[r] = f"{who} stopped answering {now - since:.0f} s ago, {where}"
        return lines

    def watch(self):
        keys, silent = [f"seen/{r}" for r in range(self.world_size)], {}
        while True:  # a daemon thread: it ends with the process
            if os.getppid() != self.parent:  # reparented: our launcher died (SIGKILL, SIGUSR1)
                self.parent, self.store_alive = os.getppid(), False  # its store may be gone too
                self.orphaned()
            self.beat += 1
            record = [*self.me, WHERE["phase"], WHERE["iteration"], self.beat]
            self.call(self.store.set, f"seen/{self.rank}", json.dumps(record))
            if self.call(self.store.check, keys):
                for r, raw in enumerate(self.call(self.store.multi_get, keys) or []):
                    if r != self.rank and self.seen.get(r, (None,))[0] != json.loads(raw):
                        self.seen[r] = json.loads(raw), time.time()
            # a peer silent in two rounds in a row: one that just left through fail() is no news
            before, silent = silent, self.silent_peers()
            posted = self.posted()
            line = posted or next((silent[r] for r in sorted(silent) if r in before), None)
            if line is not None and WHERE["phase"] not in ("exit", "end"):  # leaving: no judge
                if not posted:
                    self.post(line)
                stop = "stopping, " if posted else ""
                print(f"error [rank {self.rank}]: {stop}{line}", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(1.0)


def proc_state(pid):
    """`pid`'s state letter here (S, R, T stopped, Z zombie...); None: gone; "?": no /proc."""
    if not os.path.isdir("/proc/self"):
        return "?"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# ---- CHECKPOINTS: run name, atomic saves, pruning, resume, run time across restarts -----------
def identity(args: Args):
    """The flags that define the run: every field of Args but RESUMABLE."""
    derived = ("batch_size", "minibatch_size")  # from flags in it: a change names those flags
    return {k: v for k, v in vars(args).items() if k not in RESUMABLE + derived}


def choose_run_name(args: Args):
    """--run-name; with `--resume auto` a name from the run's identity, so the same command finds
    its own run; else a new timestamped directory, made here so no other launch takes it."""
    if args.run_name is not None:
        return args.run_name
    prefix = f"{args.env_id}__{args.exp_name}__{args.seed}__"
    if args.resume == "auto":
        digest = hashlib.sha1(json.dumps(identity(args), sort_keys=True).encode()).hexdigest()
        return f"{prefix}cfg{digest[:10]}"
    stamp = f"{prefix}{int(time.time())}"
    for n in range(1, sys.maxsize):
        name = stamp if n == 1 else f"{stamp}-{n}"
        with contextlib.suppress(FileExistsError):  # another launch in the same second
            os.makedirs(f"runs/{name}")
            return name


def checkpoint_files(ckpt_dir):
    """ckpt_<digits>.pt (not a user's ckpt_best.pt), oldest first by the step (not iteration)."""
    steps = {p: os.path.basename(p)[5:-3] for p in glob.glob(os.path.join(ckpt_dir, "ckpt_*.pt"))}
    ours = [path for path, step in steps.items() if step.isascii() and step.isdigit()]
    return sorted(ours, key=lambda path: int(steps[path]))


def save_file(obj, path):
    """torch.save to a temp file, fsync, rename: a crash or full disk mid-write leaves the older
    file intact. Any error removes the temp file and is raised as the OSError behind it."""
    try:
        with open(path + ".tmp", "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)  # the rename itself durable
        os.fsync(dir_fd)
        os.close(dir_fd)
    except Exception as e:  # e.g. torch's zip writer's RuntimeError after the OSError
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        cause = e
        while not isinstance(cause, OSError) and cause.__context__ is not None:
            cause = cause.__context__
        raise cause if isinstance(cause, OSError) else OSError(one_line(e, 160)) from e


def digest_of(ckpt):
    """sha256 of a checkpoint's values, tensors by their bytes: torch's zip reader checks no CRC."""

    def tensor(t):
        data = t.cpu().flatten().view(torch.uint8).numpy()  # any dtype, in logical order
        return [str(t.dtype), t.shape, hashlib.sha256(data).hexdigest()]

    return hashlib.sha256(json.dumps(ckpt, default=tensor).encode()).hexdigest()


def save_checkpoint(ckpt, ckpt_dir, keep):
    """save_file a new checkpoint, then prune to `keep`; a .tmp a crash left goes first."""
    os.makedirs(ckpt_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(ckpt_dir, "ckpt_*.pt.tmp")):
        os.remove(stale)
    path = os.path.join(ckpt_dir, f"ckpt_{ckpt['global_step']:012d}.pt")
    save_file(ckpt | {"digest": digest_of(ckpt)}, path)  # load_checkpoint verifies it
    for old in checkpoint_files(ckpt_dir)[:-keep]:
        if old != path:  # after a resume past a skipped bad file, the new one may sort lower
            try:
                os.remove(old)
            except OSError as e:  # the new one is saved: an old one left over is no failed save
                warn(f"old checkpoint {old} was not removed: {one_line(e, 160)}")
    return path


def load_checkpoint(path, agent):
    """A checkpoint (or a bare model state_dict) that fits `agent`, or ValueError. Tensors only
    (weights_only): a file that holds other objects is refused before anything in it runs."""
    try:
        with warnings.catch_warnings(action="ignore"):  # torch's lines on pickle: ours say it all
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        rotten = isinstance(ckpt, dict) and ckpt.pop("digest", None) not in (None, digest_of(ckpt))
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} does not exist")
    except pickle.UnpicklingError as e:
        ops = []  # the whole pickle's opcodes, read and never run (garbage or truncated: none)
        with contextlib.suppress(Exception), open(path, "rb") as f:
            ops = [op.name for op, _, _ in pickletools.genops(f)]
        builds = {"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE"}.intersection(ops)
        if "unsupported global" not in str(e).lower() and not builds:
            raise ValueError(f"checkpoint {path} is unreadable (truncated or corrupt?)")
        trust = "nothing from it was run (load only files you trust, by other means)"
        raise ValueError(f"checkpoint {path} holds objects other than tensors: refused, {trust}")
    except Exception as e:
        error = f"{type(e).__name__}: {one_line(e, 160)}"
        raise ValueError(f"checkpoint {path} is unreadable (truncated or corrupt?): {error}")
    if rotten:  # (files without a digest, older ones and bare models, load as they are)
        raise ValueError(f"checkpoint {path} is unreadable (damaged since it was saved)")
    ckpt = ckpt if isinstance(ckpt, dict) and "model" in ckpt else {"model": ckpt}
    model, own = ckpt["model"], agent.state_dict()
    if not isinstance(model, dict) or "actor.weight" not in model:
        raise ValueError(f"checkpoint {path} holds no PPO Atari model")
    n, own_n = len(model["actor.weight"]), len(own["actor.weight"])
    if n != own_n:
        env_id = ckpt.get("args", {}).get("env_id", "unknown env")
        trained = f"checkpoint {path} was trained with {n} actions ({env_id})"
        raise ValueError(f"{trained}; this env has {own_n}")
    for k in sorted(own.keys() | model.keys()):
        if k not in own or model.get(k) is None or model[k].shape != own[k].shape:
            saw = tuple(model[k].shape) if k in model else "missing"
            want = tuple(own[k].shape) if k in own else "not in this network"
            raise ValueError(f"checkpoint {path} does not fit the network: {k} {saw} vs {want}")
    return ckpt


def resume_problem(ckpt, path, args: Args):
    """Why this checkpoint cannot continue this run (None if it can)."""
    if "optimizer" not in ckpt:
        play = "resume from runs/<run>/checkpoints/ckpt_*.pt, or play it with --eval-checkpoint"
        return f"{path} holds only model weights (no optimizer state or step count): {play}"
    saved, now = ckpt.get("args", {}), identity(args)  # a field it lacks: Checkpointer.resume
    changed = [f"{flag(k)} {saved[k]} -> {v}" for k, v in now.items() if saved.get(k, v) != v]
    if changed:
        return (
            f"{path} was trained with other flags ({', '.join(changed)}): resume with the saved "
            "values (--num-envs keeps the global batch at another world size), or start a new run"
        )


def run_at_other_world_size(args: Args, run_name):
    """A sibling run (same env, experiment and seed) that differs from this launch only in the env
    count its world size made: `auto` names it rather than start over."""
    for path in sorted(glob.glob(f"runs/{glob.escape(run_name[:-10])}*/checkpoints/ckpt_*.pt")):
        with contextlib.suppress(Exception):  # a hint only: a file that does not load is none
            saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)["args"]
            if {k for k, v in identity(args).items() if saved.get(k) != v} == {"num_envs"}:
                name, n = path[5 : path.rindex("/checkpoints/")], saved["num_envs"]
                return (
                    f"run {name} has this configuration at --num-envs {n}: give --num-envs {n} to "
                    f"continue it, or --num-envs {args.num_envs} to start a new run"
                )


class Checkpointer:
    """runs/<run_name>/checkpoints: saves, resume, training time summed over restarts (true SPS)."""

    def __init__(self, args: Args, run_name, rank, world_size):
        self.args, self.run_name, self.dir = args, run_name, f"runs/{run_name}/checkpoints"
        self.rank, self.world_size, self.unlogged = rank, world_size, []
        self.save_error, self.lock, self.split, self.saved_once = None, None, None, False
        self.start = self.last_save = time.time()

    def lock_run_dir(self):
        """Rank 0 locks runs/<run_name>/lock (released when its process ends, however) and so
        checks that the run directory can be written; the verdict stops every rank."""
        error, lock = None, f"runs/{self.run_name}/lock"
        job, restart = os.environ.get("SLURM_JOB_ID"), int(os.environ.get("SLURM_RESTART_COUNT", 0))
        me = f"host {socket.gethostname()}, pid {os.getpid()}"  # requeued: the lock of a dead node?
        me += f", slurm job {job} restart {restart}" if job else ""
        if self.rank == 0:
            try:
                os.makedirs(self.dir, exist_ok=True)
                self.lock = open(lock, "a+")  # a+: the holder's line stays until we hold the lock
                fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.lock.truncate(0)
                print(me, file=self.lock, flush=True)
            except BlockingIOError:  # another process holds it
                holder = open(lock).read().strip() or "another process"
                if any(holder.endswith(f", slurm job {job} restart {r}") for r in range(restart)):
                    warn(f"{lock} is held by an earlier start of this job ({holder}): going on")
                else:
                    error = f"run {self.run_name} is already running ({holder} holds {lock})"
            except OSError as e:
                error = f"cannot write the run directory runs/{self.run_name}: {one_line(e, 160)}"
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # e.g. NFS, no lockd
                    warn(f"{lock} is on a filesystem without locks: a second launch is not refused")
                    error = None
        if error := broadcast_object(error, self.world_size > 1):
            fail(error, self.rank, self.world_size)

    def resume(self, agent, optimizer, scaler, look_around=False):
        """Load --resume into agent, optimizer and scaler on every rank; return the global step to
        continue from (0: a fresh start). A finished run ends here with exit code 0."""
        self.start = self.last_save = time.time()  # training time starts here, not at env setup
        if not self.args.resume:
            return 0
        auto, files, holder = self.args.resume == "auto", checkpoint_files(self.dir), 0
        if auto and self.world_size > 1:  # after a requeue rank 0 may be on another node
            steps = [None] * self.world_size
            dist.all_gather_object(steps, int(os.path.basename(files[-1])[5:-3]) if files else -1)
            holder = steps.index(max(steps))  # the lowest rank whose node has the newest file
        ckpt, error, path, reported = None, None, None, set()
        if self.rank == holder:  # it reads and broadcasts: the nodes need no shared disk
            for path in reversed(files) if auto else [self.args.resume]:
                try:
                    ckpt = load_checkpoint(path, agent)
                    error = resume_problem(ckpt, path, self.args)
                except ValueError as e:
                    ckpt, error = None, str(e)
                if error is None or not auto:
                    break
                if (problem := error.replace(path, "")) not in reported:  # shared: said once
                    reported.add(problem)
                    print(f"warning: skipped {error}", flush=True)
            if auto and error:  # every file was tried
                tried = ", ".join(os.path.basename(f) for f in reversed(files))
                error = f"no checkpoint in {self.dir} loads (tried {tried}); nothing was "
                error += "overwritten: move them away, or use another --run-name, to start over"
            if auto and not files and os.environ.get("PPO_RESUME_EXPECTED") == "1":  # sbatch's
                error = f"SLURM requeued this job; no rank finds a checkpoint in {self.dir} (a "
                error += "node-local disk?): give --resume PATH, or submit anew to start over"
            if auto and not files and look_around:  # a requeue at another world size?
                error = run_at_other_world_size(self.args, self.run_name) or error
        found = (ckpt, error, path, socket.gethostname())
        ckpt, error, path, host = broadcast_object(found, self.world_size > 1, src=holder)
        if error is not None:
            fail(error, self.rank, self.world_size)
        if ckpt is None:
            return 0
        step = ckpt["global_step"]
        if step >= self.args.num_iterations * self.args.batch_size:  # done if its model was saved
            done = False  # (a run preempted in its last iteration saved the total, not the model)
            with contextlib.suppress(ValueError):
                model = load_checkpoint(f"runs/{self.run_name}/{self.args.exp_name}.model", agent)
                done = all(torch.equal(v, ckpt["model"][k]) for k, v in model["model"].items())
            if broadcast_object(done, self.world_size > 1):  # rank 0's verdict: it saved the model
                if self.rank == 0:
                    print(f"run {self.run_name} is complete ({path}, step {step}): nothing to do")
                leave(0, self.world_size > 1)
        agent.load_state_dict(ckpt["model"])  # in place: the gradient views stay valid
        # The flags' settings (lr, betas, eps, weight decay, kernel), never the file's: loading
        # places each `step` by the groups' kernel flags, and a new flag must not be overridden
        ours = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        for group in ckpt["optimizer"]["param_groups"]:
            if foreign := sorted(group.keys() - ours.keys() - {"params"}):  # e.g. Adam's betas
                msg = f"{path} is another optimizer's (its {', '.join(foreign)}): start a new run"
                fail(msg, self.rank, self.world_size)
            group.update(ours)
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        if ckpt["world_size"] == self.world_size:  # --balance-envs resumes the saved split
            self.split = ckpt["args"].get("rank_envs")
        self.start -= ckpt["elapsed"]  # the run's training time before this restart
        self.unlogged = ckpt.get("unlogged", [])
        seed_everything(self.args.seed + self.rank + step)  # random streams no start has used
        if self.rank == 0:
            where = f" (on {host}, rank {holder}'s node)" if holder else ""
            at = f"iteration {step // self.args.batch_size + 1}, global step {step}"
            print(f"resumed {path}{where}: {at}; environments start fresh")
            if unknown := [flag(k) for k in identity(self.args) if k not in ckpt["args"]]:
                print(f"{path} predates {', '.join(unknown)}: this launch's values are used")
            if (was := ckpt["args"].get("total_timesteps")) != self.args.total_timesteps:
                span = "the learning-rate schedule now spans the new total"
                print(f"--total-timesteps {was} -> {self.args.total_timesteps}: {span}")
        return step

    def maybe_save(self, iteration, global_step, agent, optimizer, scaler, now=False, update_s=0):
        """Rank 0: save every --save-interval iterations and --save-minutes, at the end, and `now`.
        The path, or None: a failed save warns and training goes on; a final one sets save_error.
        The first says the grace a preemption needs: the update it may come in, then a save."""
        a = self.args
        interval = a.save_interval and iteration % a.save_interval == 0
        minutes = a.save_minutes and time.time() - self.last_save > 60 * a.save_minutes
        if not (now or iteration == a.num_iterations or interval or minutes):
            return None
        ckpt = {"model": agent.state_dict(), "optimizer": optimizer.state_dict()}
        ckpt |= {"scaler": scaler.state_dict(), "iteration": iteration, "global_step": global_step}
        ckpt |= {"args": vars(a), "world_size": self.world_size, "unlogged": list(self.unlogged)}
        ckpt["elapsed"] = time.time() - self.start  # training time (EventWriter's unlogged: kept)
        try:
            t_save, path = time.time(), save_checkpoint(ckpt, self.dir, a.keep_checkpoints)
        except OSError as e:  # the older checkpoints are intact: the next save tries again
            error = f"checkpoint at step {global_step} was not saved: {one_line(e, 160)}"
            if iteration == a.num_iterations and not now:  # MAIN stops the run with it
                last = next(reversed(checkpoint_files(self.dir)), None)
                last = f"the last good one is {last}" if last else "no checkpoint of it was saved"
                self.save_error = f"the final {error}; {last}"
            else:
                warn(f"{error}; the next save tries again")
            return None
        if not self.saved_once:
            grace = f"the update's {update_s:.1f} s + this save" if update_s else "this save"
            took = f"saved {path} in {time.time() - t_save:.1f} s: a preemption needs {grace}"
            print(f"{took} (torchrun --shutdown-timeout, default 30 s)", flush=True)
        self.last_save, self.saved_once = time.time(), True
        return path


# ---- PREEMPTION: on SIGTERM / SIGUSR1 / Ctrl-C stop the rollout, checkpoint, exit 75 / 130 ----
PREEMPTED = 75  # EX_TEMPFAIL ("try again later"): requeue and rerun with --resume auto
INTERRUPTED = 130  # 128 + SIGINT: what a shell reports after a Ctrl-C


class Preemption:
    """Notes a scheduler's warning signal or a Ctrl-C: the rollout stops at its next step, the ranks
    agree after it. After a Ctrl-C a second signal exits at once (checkpoints are atomic)."""

    def __init__(self, master_process, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)):
        self.master, self.signalled, self.since = master_process, None, 0.0
        for sig in signals:
            signal.signal(sig, self.note)

    def orphaned(self):  # the FailureBoard saw our launcher die: stop as for a scheduler's signal
        if self.signalled is None:
            self.signalled, self.since = "launcher gone", time.time()

    def note(self, signum, frame):
        name = signal.Signals(signum).name
        # within 1 s it is the same Ctrl-C (terminal, launcher); torchrun turns a 2nd into SIGTERM
        if self.signalled and "SIGINT" in (name, self.signalled) and time.time() - self.since > 1:
            if self.master:
                os.write(2, b"stopped at once (a second signal); the last checkpoint is intact\n")
            os._exit(INTERRUPTED)
        if self.signalled is None:
            self.signalled, self.since = name, time.time()

    def agreed(self, world_size, clock):
        """After each rollout, on every rank: the signalled ranks (alike on all; [] goes on)."""
        with clock:  # it waits for the slowest rank's rollout, as the update's first collective
            signals = gather_reports(self.signalled, world_size)
        return [f"rank {r}: {s}" for r, s in enumerate(signals) if s]

    def exit_after_save(self, stopped, saved, args: Args, distributed):
        """After rank 0's save every rank exits INTERRUPTED if each signal was a Ctrl-C, else
        PREEMPTED; rank 0 says what it saved and the command that continues the run."""
        code = INTERRUPTED if all(s.endswith("SIGINT") for s in stopped) else PREEMPTED
        if self.master:
            what = "interrupted" if code == INTERRUPTED else "preempted"
            saved = f"saved {saved}" if saved else "not saved (see above)"
            # the same flags; `auto` finds a run by its flags, any other run needs its name
            add = [] if args.resume == "auto" else ["--run-name", args.run_name, "--resume", "auto"]
            again = ("torchrun ... " if distributed else "python ") + shlex.join(sys.argv + add)
            line = f"{what} ({', '.join(stopped)}): {saved}; exit {code}, continue with: {again}"
            print(line, flush=True)
        WHERE["phase"] = "exit"
        if distributed:
            dist.barrier()  # a rank that left early would make torchrun stop rank 0's save
        if code == PREEMPTED and (marker := os.environ.get("PPO_PREEMPTED_MARKER")):
            open(marker, "w").write(f"{', '.join(stopped)}\n")  # the launcher requeues on it
        leave(code, distributed)


# ---- EVALUATION: full games with the final (or a saved) model ---------------------------------
def evaluate(agent, args: Args, device, run_name, max_envs=16):
    """Returns of --eval-episodes full games (all lives; FIRE after a lost life, as in training);
    each env plays as many games, so short games are not over-represented."""
    episodes, n_envs = args.eval_episodes, min(args.eval_episodes, max_envs)
    quota = math.ceil(episodes / n_envs)
    name, video, stack = f"{run_name}-eval", args.capture_video, args.frame_stack
    thunks = [make_env(args.env_id, i, video, name, stack) for i in range(n_envs)]
    envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    games = [[] for _ in range(n_envs)]  # returned by round: every env's k-th before a (k+1)-th
    next_obs, _ = envs.reset(seed=env_seeds(args.seed + 10**6, 0, n_envs))  # unseen in training
    while min(len(g) for g in games) < quota:
        with torch.inference_mode():  # eager: --compile would compile this batch size
            action = agent.get_action_and_value(torch.as_tensor(next_obs, device=device))["action"]
        next_obs, _, _, _, infos = envs.step(action.cpu().numpy())
        if "final_info" in infos and "episode" in infos["final_info"]:
            for i in np.flatnonzero(infos["final_info"]["_episode"]):
                games[i].append(float(infos["final_info"]["episode"]["r"][i]))
    envs.close()
    return [games[i][k] for k in range(quota) for i in range(n_envs)][:episodes]


def evaluate_checkpoint(args: Args, device, rank, world_size):
    """--eval-checkpoint: rank 0 plays --eval-episodes games with a saved model; all ranks exit."""
    if rank != 0:
        sys.exit(0)
    env = make_env(args.env_id, 0, False, "", args.frame_stack)()
    agent = Agent(env.observation_space.shape, env.action_space.n).to(device)
    try:
        agent.load_state_dict(load_checkpoint(args.eval_checkpoint, agent)["model"])
    except ValueError as e:
        fail(e, rank, world_size)
    returns = evaluate(agent, args, device, os.path.basename(args.eval_checkpoint))
    games = f"{len(returns)} episodes, return {np.mean(returns):.2f} +- {np.std(returns):.2f}"
    print(f"eval {args.eval_checkpoint}: {games}, range [{min(returns):g}, {max(returns):g}]")
    sys.exit(0)


# ---- ENV BACKENDS: sync / native, and --async-envs double buffering ---------------------------
class NativeVectorEnv:
    """--env-backend native: ale-py's C++ vector env (threads) behind the SyncVectorEnv API and
    info format the rollout reads, with make_env's semantics (README "Flags")."""

    def __init__(self, env_id, num_envs, num_threads, frame_stack):
        kw = gym.spec(env_id).kwargs  # e.g. game "breakout", its sticky actions and time limit
        # FIRE at a game's start only; a life loss only sets terminated; unclipped rewards: scores
        options = dict(num_threads=num_threads, batch_size=num_envs, autoreset_mode="SameStep")
        options |= dict(frameskip=4, maxpool=True, noop_max=30, use_fire_reset=True)
        options |= dict(grayscale=True, img_height=84, img_width=84, stack_num=1)
        options |= dict(episodic_life=False, life_loss_info=True, reward_clipping=False)
        options["repeat_action_probability"] = kw.get("repeat_action_probability", 0.25)
        options["full_action_space"] = kw.get("full_action_space", False)
        options["max_num_frames_per_episode"] = kw.get("max_num_frames_per_episode", 108000)
        self.env = AtariVectorEnv(kw["game"], num_envs, **options)
        self.num_envs, self.frame_stack = num_envs, frame_stack
        self.single_observation_space = gym.spaces.Box(0, 255, (frame_stack, 84, 84), np.uint8)
        self.single_action_space = self.env.single_action_space

    def _info(self, info):
        # frame_number - episode_frame_number is constant during a game; it jumps at a reset
        self.offset = info["frame_number"].astype(np.int64) - info["episode_frame_number"]
        keys = ("lives", "episode_frame_number", "frame_number")  # gymnasium: value and mask
        masks = {"_" + key: np.ones(self.num_envs, bool) for key in keys}
        return {key: info[key].astype(np.int64) for key in keys} | masks

    def reset(self, seed=None):
        if seed is not None:  # an int: env i gets seed + i (as gymnasium); else one seed per env
            seed = int(seed) if np.ndim(seed) == 0 else np.asarray(seed, dtype=np.int64)
        frame, info = self.env.reset(seed=seed)
        self.returns = np.zeros(self.num_envs)  # unclipped score of the running game, all lives
        self.stack = np.repeat(frame, self.frame_stack, axis=1)
        return self.stack, self._info(info)

    def step(self, actions):
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions):  # the C++ threads step while Python goes on (--async-envs)
        self.env.send(np.asarray(actions, dtype=np.int64))

    def step_wait(self):
        frame, reward, term, trunc, info = self.env.recv()
        old_offset = self.offset
        infos = self._info(info)
        game_over = self.offset != old_offset  # ale-py reset the game here (over or time limit)
        self.returns += reward
        done = term | trunc
        last = np.concatenate([self.stack[:, 1:], frame], axis=1)
        if game_over.any():  # SAME_STEP: `frame` is already the new game's first frame there
            last[game_over, -1] = info["final_obs"][game_over, 0]
        # a new life or game starts from copies of its first frame; a new array: an obs handed
        # out earlier (maybe shared by a CPU tensor) is never overwritten
        self.stack = np.where(done[:, None, None, None], frame, last)
        if done.any():  # as gymnasium, but final_obs is one (N, C, 84, 84) array (valid where done)
            infos.update(final_obs=last, _final_obs=done, final_info={}, _final_info=done)
            if game_over.any():
                # its length in raw frames, as make_env's RecordEpisodeStatistics counts
                length = np.where(game_over, self.offset - old_offset, 0)
                episode = {"r": np.where(game_over, self.returns, 0.0), "l": length}
                infos["final_info"] = {"episode": episode, "_episode": game_over}
        self.returns[game_over] = 0.0
        return self.stack, np.sign(reward).astype(np.float64), term, trunc, infos

    def close(self):
        self.env.close()


def merge_infos(parts, sizes):
    """--async-envs: the groups' infos as one (a key a group lacks gives zero / False rows)."""
    out = {}
    for key in set().union(*parts):
        values = [part.get(key) for part in parts]
        if any(isinstance(v, dict) for v in values):
            out[key] = merge_infos([v or {} for v in values], sizes)
            continue
        ref = next(v for v in values if v is not None)
        zeros = [np.zeros((n, *ref.shape[1:]), ref.dtype) for n in sizes]
        out[key] = np.concatenate([z if v is None else v for v, z in zip(values, zeros)])
    return out


def env_worker(*args):
    """gymnasium's env subprocess in its own session: signals are the trainer's (PREEMPTION)."""
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGINT):  # SLURM's go to a whole step; MAIN kills us
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(BrokenPipeError):  # the trainer left without closing its envs
        gym.vector.async_vector_env._async_worker(*args)


class RankEnvs:
    """This rank's envs: one group, or two for --async-envs; the time waiting for the emulators
    in env_time. Anything but uint8 frames, channels first, is refused at start."""

    def __init__(self, args: Args, run_name, capture_video, threads=None):
        self.num_envs = n = args.local_num_envs
        self.groups = [range(n)] if not args.async_envs else [range(n // 2), range(n // 2, n)]
        self.threads = threads or torch.get_num_threads()  # ale-py's, per group (native)
        env_id, stack = args.env_id, args.frame_stack
        if args.env_backend == "native":
            self.envs = [NativeVectorEnv(env_id, len(g), self.threads, stack) for g in self.groups]
        else:
            kw = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}  # no fake step after an end
            vector_env = gym.vector.SyncVectorEnv
            if args.async_envs:  # subprocesses; forkserver: never fork a process that runs CUDA
                vector_env = gym.vector.AsyncVectorEnv
                kw |= dict(context="forkserver", worker=env_worker)
            thunks = [make_env(env_id, i, capture_video, run_name, stack) for i in range(n)]
            self.envs = [vector_env(thunks[g.start : g.stop], **kw) for g in self.groups]
        self.single_observation_space = space = self.envs[0].single_observation_space
        self.single_action_space = self.envs[0].single_action_space
        if space.dtype != np.uint8 or len(space.shape) != 3 or space.shape[0] != stack:
            self.close()
            storage = f"the rollout storage holds uint8 frames, channels first ({stack}, H, W)"
            raise ValueError(f"{storage}: {env_id} gives {space.dtype} {space.shape}")
        self.env_time = 0.0

    def reset(self, seeds):
        groups = zip(self.envs, self.groups)
        return np.concatenate([env.reset(seed=[seeds[i] for i in g])[0] for env, g in groups])

    def step(self, actions):
        t = time.perf_counter()
        result = self.envs[0].step(actions)
        self.env_time += time.perf_counter() - t
        return result

    def act_and_step(self, policy, obs):
        """--async-envs: one group's envs step while the policy acts for the next (the same
        weights: still on-policy). Returns policy(obs) and step()'s result."""
        outs = []
        for env, g in zip(self.envs, self.groups):
            # copies: with --cuda-graphs the next group's replay overwrites the graph's outputs
            out = {k: t.clone() for k, t in policy(obs[g.start : g.stop]).items()}
            env.step_async(out["action"].cpu().numpy())
            outs.append(out)
        t = time.perf_counter()
        results = [env.step_wait() for env in self.envs]
        self.env_time += time.perf_counter() - t
        *arrays, infos = zip(*results)  # (obs, reward, terminated, truncated) per group, infos
        env_out = tuple(np.concatenate(x) for x in arrays)
        merged = merge_infos(infos, [len(g) for g in self.groups])
        return {k: torch.cat([out[k] for out in outs]) for k in outs[0]}, env_out + (merged,)

    def close(self):
        for env in self.envs:
            env.close()


# ---- FAST PATH AND MIXED PRECISION (README "Performance") -------------------------------------
def keep_freed_memory():
    """Serve blocks up to 1 GiB from glibc's heap, never trimmed, so minibatches do not page-fault
    their activations in again. Returns whether glibc (if that is the C library) took both."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(-3, 1 << 30) == 1  # M_MMAP_THRESHOLD
    return libc.mallopt(-1, 2**31 - 1) == 1 and ok  # M_TRIM_THRESHOLD


def network_roles(network):
    """(the network's one nn.Flatten, the parameter-free layer used once just before it in its
    nn.Sequential, or None): where the convolutions end, by role, not position. (None, None) if
    it has no Flatten or several (a side branch's would be taken for the trunk's)."""
    every = [m for _, m in network.named_modules(remove_duplicate=False)]  # shared ones repeat
    flattens = [m for m in every if isinstance(m, nn.Flatten)]
    for layers in (list(m) for m in every if isinstance(m, nn.Sequential) and len(flattens) == 1):
        if flattens[0] in layers[1:]:
            before = layers[layers.index(flattens[0]) - 1]
            free = next(before.parameters(), None) is None and every.count(before) == 1
            return flattens[0], before if free else None
    return (flattens[0] if len(flattens) == 1 else None), None


def speed_up(agent, args: Args, overlap=False, say=None):
    """Same-math layout changes and the opt-in compile (call BEFORE flat_grad_buffer); a trick the
    network does not fit is skipped, `say` told once. `overlap`: buckets go out during backward."""
    flatten, last_activation = network_roles(agent.network)
    skipped = []
    if args.channels_last:
        agent = agent.to(memory_format=torch.channels_last)
        # ReLU's backward is far slower when its gradient (NCHW, from Flatten) and its saved
        # output differ in layout: its input goes NCHW (Flatten copies so anyway)
        if last_activation is not None:
            last_activation.register_forward_pre_hook(lambda _, inputs: (inputs[0].contiguous(),))
        elif any(p.dim() == 4 for p in agent.parameters()):
            slower = "the last activation's backward runs in mixed layouts (slower)"
            skipped.append(f"no parameter-free layer just before nn.Flatten: {slower}")
    if args.compile:
        # plain attributes (state_dict unchanged); fixed shapes; get_value (sizes vary) stays eager
        fixed = dict(dynamic=False, mode="reduce-overhead" if args.cuda_graphs else None)
        # torch 2.13's kernel cache ignores ATEN_CPU_CAPABILITY (another capability's kernel
        # aborts or gives NaN): one default cache per capability; a user's own dir stays.
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
            isa = torch.backends.cpu.get_cpu_capability()
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{isa}"
        # CPU under --amp: eager autocast casts the weights once per rollout, compiled every step
        if args.amp == "none" or next(agent.parameters()).is_cuda:
            agent.compiled_policy = torch.compile(agent.get_action_and_value, **fixed)
        agent.compiled_loss = torch.compile(ppo_loss, **fixed)
        # one graph's backward is one node (no bucket leaves before it ends): a graph break where
        # the convolutions end, in training only, overlaps the all-reduce as eager does
        if overlap and flatten is not None:
            flatten.register_forward_pre_hook(
                lambda *_: torch._dynamo.graph_break() if torch.is_grad_enabled() else None
            )
        elif overlap:
            skipped.append("not one nn.Flatten: under --compile the all-reduce waits for backward")
    if skipped and say:
        say(f"fast path: {'; '.join(skipped)}")
    return agent


def network_input(x, first_weight):
    """Frames / 255 in the first layer's layout and (under --amp) dtype: uint8 is reordered
    before the division (4x fewer bytes) and cast straight to the autocast dtype (same values)."""
    if first_weight.is_contiguous(memory_format=torch.channels_last) and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    dtype = torch.float32
    if x.dtype == torch.uint8 and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    # convert, then divide in place: two vectorised passes, faster than one mixed-type div
    return x.to(dtype, copy=True).div_(255.0)


def gather_frames(frames, i):
    """frames[i] in the layout of `frames` (index_select alone returns NCHW, to reorder again)."""
    if frames.is_contiguous(memory_format=torch.channels_last):
        return frames.permute(0, 2, 3, 1).index_select(0, i).permute(0, 3, 1, 2)
    return frames.index_select(0, i)


def frame_buffer(shape, channels_last, device):
    """Zeroed uint8 rollout storage (steps, envs, C, H, W) in the conv weights' layout."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    size = (shape[0] * shape[1], *shape[2:])
    flat = torch.empty(size, dtype=torch.uint8, device=device, memory_format=layout)
    return flat.zero_().view(shape)


def upload(array, device):
    """A numpy array on `device` (on CPU sharing its memory); on CUDA pinned and non_blocking."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


class StepUpload:
    """A step's frames, float32 rewards and 0/1 float dones to the device in ONE copy of one
    reused host buffer (pinned on CUDA). On CPU the tensors are views valid until the next call."""

    def __init__(self, device):
        self.device, self.host, self.copied = device, None, None

    def __call__(self, frames, reward, done):
        n, size = len(frames), frames.size
        if self.host is None or self.host.numel() != size + 8 * n:  # first, or --balance-envs
            cuda = self.device.type == "cuda"
            self.host = torch.empty(size + 8 * n, dtype=torch.uint8, pin_memory=cuda)
        elif self.copied is not None:
            self.copied.synchronize()  # the last step's copy has read the buffer
        self.host[:size].view(frames.shape).copy_(torch.from_numpy(frames))
        floats = self.host[size:].view(torch.float32)
        floats[:n].copy_(torch.from_numpy(reward))
        floats[n:].copy_(torch.from_numpy(done))
        out = self.host.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        floats = out[size:].view(torch.float32)
        return out[:size].view(frames.shape), floats[:n], floats[n:]


def precision(args: Args, device):
    """Autocast and a GradScaler (fp16 only), no-ops where disabled: the loop never branches."""
    dtype = torch.float16 if args.amp == "fp16" else torch.bfloat16
    autocast = torch.autocast(device.type, dtype=dtype, enabled=args.amp != "none")
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    return autocast, scaler


def slow_bf16_warning(args: Args, device):
    """A warning line for --amp bf16 where oneDNN may emulate bf16 on this CPU (slow); else None."""
    if args.amp != "bf16" or device.type != "cpu":
        return None
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    capped = isa not in ("ALL", "DEFAULT") and not any(s in isa for s in ("BF16", "AMX"))
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if native and not capped and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    cpu = f"cpu capability {torch.backends.cpu.get_cpu_capability()}, ONEDNN_MAX_CPU_ISA={isa}"
    slower = "bf16 is emulated here and usually several times slower than the default fp32"
    return f"warning: --amp bf16 on a CPU without native bf16 for oneDNN ({cpu}): {slower}"


# ---- MONITORING: resources and time split per rank, load balance, progress line ---------------
def host_rss_gb():
    """This process's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / (2**30 if sys.platform == "darwin" else 2**20)


def gpu_util(device):
    """NVML's % of its last sample period (1/6-1 s) with a kernel running; None off CUDA or NVML."""
    try:
        return float(torch.cuda.utilization(device)) if device.type == "cuda" else None
    except Exception:
        return None


def rank_resources(device, utils):
    """Host RSS; on CUDA the peak GPU memory since the last call and the mean of `utils` (read at
    the rollout's and the update's end: one alone describes only the phase before it)."""
    out = {"host_rss_gb": host_rss_gb()}
    if device.type == "cuda":
        out["gpu_mem_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["gpu_mem_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
        if None not in utils:
            out["gpu_util"] = sum(utils) / len(utils)
    return out


def time_shares(times):
    """Where one iteration's time went (all-reduce includes waiting for slower ranks)."""
    env, allreduce = times["env"], times["allreduce"]
    inference, update = times["rollout"] - env, times["update"] - allreduce
    parts = {"env": env, "inference": inference, "update": update, "allreduce": allreduce}
    return {name: seconds / (times["rollout"] + times["update"]) for name, seconds in parts.items()}


def busy_seconds(times):
    """The iteration without the collectives, whose waits give every rank the slowest's time."""
    return times["rollout"] + times["update"] - times["allreduce"]


def load_imbalance(busy):
    """(slowest rank's busy seconds over the mean, that rank)."""
    mean = sum(busy) / len(busy)
    slow = max(range(len(busy)), key=busy.__getitem__)
    return (busy[slow] / mean if mean > 0 else 1.0), slow


class Progress:
    """Rank 0's TensorBoard tags of every rank, the progress line and the summary at the end."""

    def __init__(self, args: Args, start_step):
        self.args, self.start_step = args, start_step
        self.start = self.last = time.time()
        self.recent_returns, self.num_episodes = deque(maxlen=100), 0

    def log(self, writer, reports, iteration, global_step, sps, charts, stats):
        """The per-iteration logging; `reports`: every rank's (MAIN gathers them)."""
        for step_at, ret, length in sorted(e for r in reports for e in r["episodes"]):
            writer.add_scalar("charts/episodic_return", ret, step_at)
            writer.add_scalar("charts/episodic_length", length, step_at)
            self.recent_returns.append(ret)
            self.num_episodes += 1
        for name, value in charts.items():  # the learning rate and the loss coefficients
            writer.add_scalar(f"charts/{name}", value, global_step)
        for name, value in stats.items():
            writer.add_scalar(f"losses/{name}", value, global_step)
        envs, evs = np.array([[r["envs"], r["explained_variance"]] for r in reports]).T
        ok = ~np.isnan(evs)  # weighted by samples, over the ranks that have one
        ev = np.average(evs[ok], weights=envs[ok]) if ok.any() else np.nan
        writer.add_scalar("losses/explained_variance", ev, global_step)
        writer.add_scalar("charts/SPS", sps, global_step)
        for r, rep in enumerate(reports):
            writer.add_scalar(f"perf/envs/rank{r}", rep["envs"], global_step)
            for key, seconds in rep["times"].items():
                writer.add_scalar(f"perf/{key}_s/rank{r}", seconds, global_step)
            for key, share in time_shares(rep["times"]).items():
                writer.add_scalar(f"perf/share_{key}/rank{r}", share, global_step)
            for key, value in rep["resources"].items():
                writer.add_scalar(f"perf/{key}/rank{r}", value, global_step)
        imbalance = load_imbalance([busy_seconds(rep["times"]) for rep in reports])
        writer.add_scalar("perf/imbalance", imbalance[0], global_step)
        if line := self.line(iteration, global_step, sps, imbalance):
            print(line, flush=True)
        writer.flush()  # each iteration: a failed write is seen and its scalars kept

    def line(self, iteration, global_step, sps, imbalance):
        """The line at the first and last iteration and every --print-every seconds, else None."""
        now, args = time.time(), self.args
        first = global_step - self.start_step <= args.batch_size
        if not (first or iteration == args.num_iterations or now - self.last >= args.print_every):
            return None
        self.last = now
        rate = (global_step - self.start_step) / max(now - self.start, 1e-9)
        eta = (args.num_iterations * args.batch_size - global_step) / max(rate, 1e-9)
        mean_return = f"{np.mean(self.recent_returns):.2f}" if self.recent_returns else "-"
        ratio, slow = imbalance
        slowest = f" | imbalance {ratio:.2f}: rank {slow} is slowest" if ratio > 1.05 else ""
        return (
            f"iter {iteration}/{args.num_iterations} | step {global_step} | "
            f"{clock(now - self.start)} elapsed, ETA {clock(eta)} | SPS {sps} | return "
            f"{mean_return} (last {len(self.recent_returns)} of {self.num_episodes} episodes)"
            f"{slowest}"
        )

    def summary(self, global_step, elapsed, replicas_ok):
        """The end's line (per-rank seconds and memory: TensorBoard's perf/ tags)."""
        mean_return = f"{np.mean(self.recent_returns):.2f}" if self.recent_returns else "n/a"
        return (
            f"done: {global_step} steps in {clock(elapsed)}, SPS {int(global_step / elapsed)}, "
            f"mean return (last {len(self.recent_returns)} episodes) {mean_return}, "
            f"{self.num_episodes} episodes, replicas identical: {replicas_ok}"
        )


class EventWriter(SummaryWriter):
    """A SummaryWriter a full disk cannot thin out: the scalars since its last good flush (once per
    iteration; the newest 100k) wait in memory and in a checkpoint, then go to a new events file.
    Its purge step hides what a crashed run logged after its checkpoint or the failed file holds."""

    def __init__(self, log_dir, global_step, unlogged=()):  # unlogged: from the checkpoint
        steps = [global_step + 1 if global_step else 0, *(step for _, _, step, _ in unlogged)]
        super().__init__(log_dir, purge_step=min(steps))
        self.kept, self.failed_at, hook = deque(maxlen=100_000), None, threading.excepthook
        # its writer thread's error comes back through write(), without a traceback
        threading.excepthook = lambda a: type(a.thread).__name__ == "_AsyncWriterThread" or hook(a)
        for scalar in unlogged:
            self.add_scalar(*scalar)

    def write(self, method, *args, **kwargs):
        try:
            if self.failed_at is None:
                return method(*args, **kwargs) or True
        except Exception as e:
            self.failed_at = time.time()
            warn(f"TensorBoard events wait in memory: {one_line(e, 160)}; training goes on")

    def add_scalar(self, tag, value, step, walltime=None):  # plain numbers: a checkpoint loads them
        self.kept.append((tag, float(value), int(step), walltime or time.time()))
        self.write(super().add_scalar, tag, value, step, walltime)

    def add_text(self, *args, **kwargs):
        self.write(super().add_text, *args, **kwargs)

    def flush(self, now=False):
        retry = self.failed_at is not None and (now or time.time() - self.failed_at > 10)
        if retry and shutil.disk_usage(self.log_dir).free > 2**20:  # a new file, all kept again
            self.file_writer = self.all_writers = self.failed_at = None
            steps = [step for tag, _, step, _ in self.kept if not tag.startswith("eval/")]
            self.purge_step = min(steps, default=None)  # (eval/ steps count games)
            for scalar in self.kept:
                self.write(SummaryWriter.add_scalar, self, *scalar)
        if self.write(super().flush):
            if retry:
                print(f"TensorBoard events written again ({len(self.kept)} kept)", flush=True)
            self.kept.clear()

    def close(self):
        self.flush(now=True)
        self.write(super().close)


class CollectiveClock:
    """`with clock:` times a block; read() sums them since the last read. NCCL only enqueues, so
    on CUDA events bracket each block, read once per iteration (no sync per minibatch)."""

    def __init__(self, device):
        self.cuda, self.events = device.type == "cuda", []

    def mark(self, *exc):  # entering and leaving alike: a CUDA event, else the host clock
        now = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
        self.events.append(now)
        if self.cuda:
            now.record()

    __enter__ = __exit__ = mark

    def read(self):
        pairs, self.events = list(zip(self.events[::2], self.events[1::2])), []
        if not self.cuda:
            return sum(end - start for start, end in pairs)
        if pairs:
            pairs[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in pairs) / 1000


def clock(seconds):
    return str(datetime.timedelta(seconds=int(seconds)))


def gather_reports(report, world_size):
    """Every rank's report of this iteration on every rank (one all_gather_object)."""
    reports = [report] * world_size
    if world_size > 1:
        dist.all_gather_object(reports, report)
    return reports


def print_setup(args: Args, backend, device, torch_threads, env_threads, warnings_):
    """Rank 0's lines at start: the run, its layout and sizes, and any warnings."""
    native = f", {env_threads} per env group" if args.env_backend == "native" else ""
    layout = f"backend {backend or '-'}, device {device.type}, {torch_threads} thread(s) per rank"
    print(f"run {args.run_name}: {args.world_size} rank(s), {layout}{native}")
    sizes = "local_num_envs num_envs num_steps | local_batch_size batch_size num_minibatches | "
    for row in (sizes + "local_minibatch_size minibatch_size grad_accum num_iterations").split("|"):
        print("  " + " | ".join(f"{k} {getattr(args, k)}" for k in row.split()))
    if args.rank_envs:
        print(f"  rank_envs {args.rank_envs} (local sizes: rank 0's)")
    for warning in filter(None, warnings_):
        print(warning)


# ---- BALANCE: --balance-envs moves envs from slower ranks to faster ones (README "Uneven ranks") -
BALANCE_AT = 1.10  # move envs when the imbalance stayed above this
BALANCE_FOR = 2  # for this many iterations (the first after a start or a move warms up),
BALANCE_EVERY = 3  # never within this many iterations of the last move,
BALANCE_GAIN = 0.05  # only to a split predicted to cut the slowest rank's time by this much,
BALANCE_MEMORY = 50  # not one measured no faster within this many iterations (no flip-flop)


class Balancer:
    """Each granule of envs goes to the rank that would finish it first; num_envs stays. Every
    rank decides alike from the same all-gathered times (no broadcast)."""

    def __init__(self, args: Args, world_size):
        self.enabled = args.balance_envs and world_size > 1
        self.since_move, self.measured, self.iteration = [], {}, 0  # busy seconds; split -> time
        k = args.num_minibatches * args.grad_accum  # every rank's batch must split into these
        self.granule = k // math.gcd(args.num_steps, k)
        self.min_envs = self.granule * math.ceil((2 if args.async_envs else 1) / self.granule)

    def fits(self, split, args: Args):  # a saved split: this world size, num_envs and granule
        ok = self.enabled and split is not None and len(split) == len(args.rank_envs)
        ok = ok and sum(split) == args.num_envs and min(split) >= self.min_envs
        return ok and all(n % self.granule == 0 for n in split)

    def decide(self, split, busy):
        """After an iteration's busy seconds: (new split, imbalance, predicted one) or None."""
        if not self.enabled:
            return None
        self.since_move.append(busy)
        self.iteration += 1
        window = self.since_move[1:][-BALANCE_FOR:]
        if len(self.since_move) < BALANCE_EVERY or len(window) < BALANCE_FOR:
            return None
        seconds = [sum(b[r] for b in window) / len(window) for r in range(len(split))]
        slowest = max(seconds)
        self.measured[tuple(split)] = slowest, self.iteration
        if min(load_imbalance(b)[0] for b in window) <= BALANCE_AT:
            return None
        speed = [n / t for n, t in zip(split, seconds)]  # envs per busy second
        new = [self.min_envs] * len(split)
        for _ in range((sum(split) - sum(new)) // self.granule):
            r = min(range(len(new)), key=lambda r: (new[r] + self.granule) / speed[r])
            new[r] += self.granule
        predicted = [n / v for n, v in zip(new, speed)]
        goal = (1 - BALANCE_GAIN) * slowest
        was, when = self.measured.get(tuple(new), (0.0, -BALANCE_MEMORY))
        if max(predicted) > goal or (self.iteration - when < BALANCE_MEMORY and was > goal):
            return None
        self.since_move = []
        return new, load_imbalance(seconds)[0], load_imbalance(predicted)[0]


def resize_envs(envs, args: Args, split, rank, run_name, capture_video):
    """Apply a split on this rank: local sizes, fresh envs if its count changed; (envs, new?)."""
    args.rank_envs, n = list(split), split[rank]
    args.local_num_envs, args.local_batch_size = n, n * args.num_steps
    args.local_minibatch_size = args.local_batch_size // args.num_minibatches
    if envs.num_envs == n:
        return envs, False
    envs.close()
    return RankEnvs(args, run_name, capture_video, envs.threads), True


# ---- RUN-TIME CHECKS ---------------------------------------------------------------------------
def check_iteration(params, buckets, scaler, iteration, global_step, rank, world_size):
    """Stop before NaN/inf reaches a checkpoint or a broken flat buffer stops gradient averaging
    (the values are all-reduced: every rank reaches the same verdict)."""
    where = f"at iteration {iteration}, global step {global_step}"
    if not torch.isfinite(buckets.stats).all():
        values = ", ".join(f"{k}={v:g}" for k, v in zip(LOSS_STATS, buckets.stats.tolist()))
        fail(f"non-finite loss {where}: {values}", rank, world_size)
    grads = buckets.flat[: -len(LOSS_STATS)]  # fp16: the scaler skips inf gradients by itself
    if not scaler.is_enabled() and not torch.isfinite(grads).all():
        fail(f"non-finite gradient {where}", rank, world_size)
    if not grads_in_buffer(params, buckets.flat):
        msg = "gradients no longer live in the flat buffer (see flat_grad_buffer's invariants)"
        fail(f"{msg} {where}", rank, world_size)


def broadcast_from_rank0(tensors):
    """Rank 0's values into `tensors` on every rank, in place (the .grad views stay valid)."""
    for tensor in tensors:
        collective(dist.broadcast, tensor, src=0)


def replicas_identical(agent, device, distributed):
    """Compare every rank's weights and buffers with rank 0's (one broadcast, a tiny all-reduce)."""
    if not distributed:
        return True
    state = torch.cat([t.detach().reshape(-1).double() for t in agent.state_dict().values()])
    reference = state.clone()
    collective(dist.broadcast, reference, src=0)
    same = torch.tensor([float(torch.equal(state, reference))], device=device)
    collective(dist.all_reduce, same, op=dist.ReduceOp.MIN)
    return bool(same.item())


# ================================================================================================
# MAIN
# ================================================================================================
if __name__ == "__main__":
    args = tyro.cli(Args)
    name_follows_world_size = not (args.run_name or args.num_envs or args.rank_envs)

    # ---- setup: torchrun's environment; plain `python` runs one process without a group ----
    distributed = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if distributed else 1
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    master_process = rank == 0
    sys.excepthook = crash_report = CrashReport(rank, args.pg_timeout)
    # From here a SIGTERM is only noted: a rank that torchrun stops because a peer failed first
    # still prints its own error, and a scheduler's warning ends the run after a checkpoint.
    preemption = Preemption(master_process)
    # Validate everything BEFORE any collective: every rank reaches the same verdict and exits,
    # so bad input can never leave a peer waiting in a collective.
    try:
        check_launch(os.environ)
        flag_warnings = check_args(args, world_size, rank)
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        layout = (rank, local_rank, world_size, local_world_size)
        device, backend = choose_device(args, *layout, num_gpus)
    except ValueError as e:
        fail(e, rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    crash_report.device = device
    torch_threads, env_threads = thread_counts(args, device, local_world_size)
    torch.set_num_threads(torch_threads)
    keep_freed_memory()
    if args.eval_checkpoint:  # evaluation only: rank 0 plays, every rank exits
        evaluate_checkpoint(args, device, rank, world_size)
    if distributed:
        board_store = init_distributed(backend, rank, world_size, args.pg_timeout)
        board = FailureBoard(board_store, rank, world_size, args.pg_timeout, preemption.orphaned)
        crash_report.board = board
        sys.excepthook = crash_report  # init_process_group wrapped it; ours names the rank
        check_same_flags(args, rank, world_size)
    elif master_process:
        print("single process (launch with `torchrun --nproc_per_node=N` for data parallelism)")
    name = choose_run_name(args) if master_process else None  # made once, told to every rank
    run_name = args.run_name = broadcast_object(name, distributed)
    checkpointer = Checkpointer(args, run_name, rank, world_size)
    checkpointer.lock_run_dir()  # a second launch of this run, or an unwritable directory, stops
    if master_process:
        warnings_ = [*flag_warnings, slow_bf16_warning(args, device)]  # no group: no backend
        print_setup(args, distributed and backend, device, torch_threads, env_threads, warnings_)
        if args.track:
            import wandb

            project = dict(project=args.wandb_project_name, entity=args.wandb_entity)
            setup = dict(sync_tensorboard=True, config=vars(args), name=run_name, save_code=True)
            wandb.init(**project, **setup, monitor_gym=True)

    # Seeding: distinct env seeds on every rank; python/numpy/torch streams differ per rank
    seed_everything(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # env setup
    video = args.capture_video and master_process
    try:
        envs = RankEnvs(args, run_name, video, env_threads)
    except ValueError as e:
        fail(e, rank, world_size)
    atexit.register(lambda: [p.kill() for e in envs.envs for p in getattr(e, "processes", [])])

    agent = Agent(envs.single_observation_space.shape, envs.single_action_space.n).to(device)
    batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in agent.modules())
    if args.grad_accum > 1 and batch_norm and master_process:
        warn("--grad-accum under BatchNorm: each micro-batch's statistics, not the same gradient")
    if distributed:  # every replica starts from rank 0's weights and buffers (BatchNorm's)
        broadcast_from_rank0(agent.state_dict().values())
    overlap = world_size > 1 and args.bucket_mb > 0
    agent = speed_up(agent, args, overlap, say=print if master_process else None)
    policy = getattr(agent, "compiled_policy", agent.get_action_and_value)  # --compile
    autocast, scaler = precision(args, device)
    # foreach: bit-identical to torch's default per-tensor loop on CPU, and faster; not fused: it
    # rounds differently, and a default may only change speed. --compile: fused (faster).
    kernel = {"fused": True} if args.compile else {"foreach": True}
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, **kernel)
    params = [p for p in agent.parameters() if p.requires_grad]  # frozen ones get no gradient
    flat_grads = flat_grad_buffer(params, len(LOSS_STATS))
    collective_clock = CollectiveClock(device)
    buckets = GradBuckets(
        params, flat_grads, args.bucket_mb, world_size, args.allreduce_fp16, clock=collective_clock
    )
    coef = loss_coefficients(args, device)  # 0-d tensors: a schedule below changes them in place
    state = (agent, optimizer, scaler)  # what a checkpoint holds

    global_step = checkpointer.resume(agent, optimizer, scaler, name_follows_world_size)
    start_iteration = global_step // args.batch_size + 1
    if master_process:
        writer = EventWriter(f"runs/{run_name}", global_step, checkpointer.unlogged)
        checkpointer.unlogged = writer.kept  # what a full disk kept from TensorBoard: saved too
        atexit.register(writer.close)  # flush the logs even when the run fails
        table = "\n".join([f"|{k}|{v}|" for k, v in vars(args).items()])
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")

    balancer = Balancer(args, world_size)
    if balancer.fits(checkpointer.split, args):  # --balance-envs resumes from the saved split
        envs, _ = resize_envs(envs, args, checkpointer.split, rank, run_name, video)
        if master_process:
            print(f"envs {' '.join(map(str, args.rank_envs))}: the split saved in the checkpoint")

    # ALGO Logic: Storage setup; a resumed run gets fresh games, with seeds no earlier start used
    storage, next_obs, next_done = start_rollouts(envs, args, args.seed + global_step, rank, device)
    obs, actions, logprobs, rewards, dones, values, bootstraps = storage
    progress = Progress(args, global_step)
    step_upload = StepUpload(device)

    for iteration in range(start_iteration, args.num_iterations + 1):
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate
        # a schedule of a loss coefficient is one line here, e.g.
        # coef["ent_coef"].fill_(args.ent_coef * (1 - iteration / args.num_iterations))

        # ---- rollout ----
        WHERE.update(phase="rollout", iteration=iteration)
        t_rollout, envs.env_time, episodes = time.perf_counter(), 0.0, []
        bootstraps.zero_()  # gamma * V(final obs) where a time limit cut a game
        # One no-grad/autocast region per rollout: under --amp the weights are cast once, not every
        # step (autocast caches no casts under inference_mode, hence no_grad)
        with torch.no_grad(), autocast:
            for step in range(args.num_steps):
                if preemption.signalled:  # a resume discards a partial rollout: stop it now
                    break
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done
                # act on the stored copy: it is already in the weights' layout (no second reorder)
                if args.async_envs:  # the policy acts for one env group while the other steps
                    out, env_out = envs.act_and_step(policy, obs[step])
                else:
                    out = policy(obs[step])
                    env_out = envs.step(out["action"].cpu().numpy())
                next_obs_np, reward, terminations, truncations, infos = env_out
                values[step] = out["value"].flatten()
                actions[step] = out["action"]
                logprobs[step] = out["logprob"]

                if "final_info" in infos:
                    # a time limit is not a real end: bootstrap from the final observation's value
                    cut = np.flatnonzero(truncations & ~terminations)
                    if len(cut):
                        final_obs = upload(np.stack(infos["final_obs"][cut]), device)
                        final_value = agent.get_value(final_obs).flatten()
                        bootstraps[step, torch.as_tensor(cut)] = args.gamma * final_value
                    if "episode" in infos["final_info"]:
                        ep = infos["final_info"]["episode"]
                        for i in np.flatnonzero(infos["final_info"]["_episode"]):
                            episodes.append((global_step, float(ep["r"][i]), int(ep["l"][i])))
                next_obs, rewards[step], next_done = step_upload(
                    next_obs_np, reward, terminations | truncations
                )
        rollout_time, rollout_util = time.perf_counter() - t_rollout, gpu_util(device)
        # ---- preemption: any rank's signal -> every rank saves the last update's state, exits --
        if stopped := preemption.agreed(world_size, collective_clock):
            global_step, done = (iteration - 1) * args.batch_size, iteration - 1
            saved = master_process and checkpointer.maybe_save(done, global_step, *state, now=True)
            preemption.exit_after_save(stopped, saved, args, distributed)

        # ---- advantages (GAE) ----
        WHERE["phase"], t_update = "update", time.perf_counter()
        with torch.no_grad(), autocast:
            next_value = agent.get_value(next_obs).reshape(1, -1)
            rollout = (rewards + bootstraps, values, dones, next_value, next_done)
            advantages, returns = compute_gae(*rollout, args.gamma, args.gae_lambda)
        # ---- PPO update: the flat gradient buffer all-reduced per minibatch ----
        # the batch by name (steps x envs flattened): a new target is one more entry
        batch = dict(obs=obs, actions=actions, logprobs=logprobs, values=values, rewards=rewards)
        batch |= dict(advantages=advantages, returns=returns)
        batch = {k: v.flatten(0, 1) for k, v in batch.items()}
        b_inds = np.arange(args.local_batch_size)
        stats_sum, num_updates = torch.zeros_like(buckets.stats), 0
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            epoch_inds = upload(b_inds, device)  # one copy per epoch, none per minibatch
            for start in range(0, args.local_batch_size, args.local_minibatch_size):
                mb_inds = epoch_inds[start : start + args.local_minibatch_size]
                minibatch_gradient(agent, args, coef, batch, mb_inds, buckets, autocast, scaler)
                buckets.wait()  # the all-reduce: gradients and LOSS_STATS averaged over ranks
                scaler.unscale_(optimizer)  # fp16: clip the true gradient (otherwise a no-op)
                nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                scaler.step(optimizer)  # fp16: skips a step with inf/NaN, alike on every rank
                scaler.update()
                stats_sum += buckets.stats
                num_updates += 1
            # every rank reads the same all-reduced KL, so every rank stops at the same step
            approx_kl = buckets.stats[LOSS_STATS.index("approx_kl")]
            if args.target_kl is not None and approx_kl.item() > args.target_kl:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()  # for the timing only: the update's kernels may be queued
        update_time = time.perf_counter() - t_update
        if distributed:  # no gradient averages BatchNorm's running statistics: rank 0's, as DDP
            broadcast_from_rank0(agent.buffers())
        check_iteration(params, buckets, scaler, iteration, global_step, rank, world_size)

        # ---- logging: every rank's episodes and timings, the losses averaged over ranks ----
        y_pred, y_true = batch["values"].cpu().numpy(), batch["returns"].cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
        times = {"rollout": rollout_time, "env": envs.env_time, "update": update_time}
        report = {
            "episodes": episodes,
            "explained_variance": explained_var,
            "envs": args.local_num_envs,
            "times": dict(times, allreduce=collective_clock.read()),
            "resources": rank_resources(device, [rollout_util, gpu_util(device)]),
        }
        WHERE["phase"] = "report"
        reports = gather_reports(report, world_size)
        if master_process:
            stats = dict(zip(LOSS_STATS, (stats_sum / num_updates).tolist()))  # iteration means
            sps = int(global_step / (time.time() - checkpointer.start))
            charts = {name: c.item() for name, c in coef.items()}  # scheduled or not
            charts["learning_rate"] = optimizer.param_groups[0]["lr"]
            progress.log(writer, reports, iteration, global_step, sps, charts, stats)

        # ---- balance (--balance-envs): every rank decides alike from the gathered times ----
        if moved := balancer.decide(args.rank_envs, [busy_seconds(r["times"]) for r in reports]):
            split, imbalance, predicted = moved
            if master_process:
                old, new = (" ".join(map(str, s)) for s in (args.rank_envs, split))
                print(
                    f"envs {old} -> {new}, imbalance {imbalance:.2f} -> {predicted:.2f} (predicted)"
                )
            envs, rebuilt = resize_envs(envs, args, split, rank, run_name, video)
            if rebuilt:
                seed = args.seed + global_step
                storage, next_obs, next_done = start_rollouts(envs, args, seed, rank, device)
                obs, actions, logprobs, rewards, dones, values, bootstraps = storage

        # ---- checkpoint (a signal in this update stops the next rollout at once) ----
        WHERE["phase"] = "save"
        if master_process:
            checkpointer.maybe_save(iteration, global_step, *state, update_s=update_time)

    # ---- the end: replicas must still agree; save, evaluate, leave ----
    WHERE["phase"] = "end"
    replicas_ok = replicas_identical(agent, device, distributed)
    envs.close()
    if distributed:
        dist.destroy_process_group()  # evaluation below is rank 0's alone: no peer waits on it
    if checkpointer.save_error:  # rank 0's final save failed: the run did not end on disk
        fail(checkpointer.save_error, rank, world_size, code=1)
    if master_process:
        training_time = time.time() - checkpointer.start
        print(progress.summary(global_step, training_time, replicas_ok), flush=True)
        model_path = f"runs/{run_name}/{args.exp_name}.model"
        try:
            save_file(agent.state_dict(), model_path)
        except OSError as e:
            fail(f"the final model {model_path} was not saved: {one_line(e, 160)}", 0, 1, code=1)
        if args.eval_episodes > 0:
            returns = evaluate(agent, args, device, run_name)
            for idx, episodic_return in enumerate(returns):
                writer.add_scalar("eval/episodic_return", episodic_return, idx)
            mean, std = np.mean(returns), np.std(returns)
            print(f"eval {model_path}: {len(returns)} episodes, return {mean:.2f} +- {std:.2f}")
        writer.close()
        if args.track:
            wandb.finish()
    leave(0 if replicas_ok else 1, distributed)
