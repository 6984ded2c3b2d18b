"""The optimized default update path against the straightforward computation (CPU)."""
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import ppo_atari_multigpu as ppo
from conftest import ROOT


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
            torch.randint(0, 4, (n,), generator=g), -1.4 + 0.1 * torch.randn(n, generator=g),
            torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g))


def straightforward(updates, args):
    """CleanRL's way: float observations, fresh .grad tensors, optimizer.zero_grad(), per-tensor Adam."""
    torch.manual_seed(0)
    agent = ppo.Agent(4)
    opt = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    for u in range(updates):
        obs, act, logp, adv, ret, val = data(seed=u)
        adv = ppo.normalize_advantages(adv, 1)
        loss, _ = ppo.ppo_loss(agent, args, obs.float(), act, logp, adv, ret, val)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in agent.parameters()])


def optimized(updates, args):
    """The trainer's path: uint8 observations, gradients as views of one flat buffer, foreach Adam."""
    torch.manual_seed(0)
    agent = ppo.Agent(4)
    if args.channels_last:
        agent = agent.to(memory_format=torch.channels_last)
    params = list(agent.parameters())
    opt = torch.optim.Adam(params, lr=2.5e-4, eps=1e-5, foreach=True)
    flat = ppo.flat_grad_buffer(params, ppo.NUM_STATS)
    for u in range(updates):
        batch = data(seed=u)
        ppo.minibatch_gradient(agent, args, flat, flat.numel() - ppo.NUM_STATS, batch,
                               np.arange(len(batch[0])), 1)
        nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def test_optimized_update_is_bit_identical_to_straightforward_update_without_channels_last():
    args = ppo.Args(channels_last=False)
    assert torch.equal(optimized(4, args), straightforward(4, args))


def test_channels_last_update_differs_from_straightforward_only_by_rounding():
    # channels-last runs other oneDNN kernels, which sum the convolutions' products in another
    # order: one update agrees to float rounding. Adam then amplifies rounding for weights whose
    # gradients are ~0 (m / sqrt(v) of two tiny numbers), but no Adam step moves a weight by more
    # than about the learning rate, which bounds the difference after k updates by k * lr.
    args = ppo.Args(channels_last=True)
    one = (optimized(1, args) - straightforward(1, args)).abs()
    assert one.max() < 1e-6
    four = (optimized(4, args) - straightforward(4, args)).abs()
    assert four.max() <= 4 * 2.5e-4
    assert (four > 1e-6).float().mean() < 1e-3  # nearly every weight still agrees to rounding


def test_compiled_run_trains_and_saves_a_checkpoint_a_plain_agent_loads(run_trainer, tmp_path):
    out = run_trainer("--no-cuda", "--local-num-envs", "2", "--num-steps", "32", "--update-epochs", "1",
                      "--num-minibatches", "2", "--total-timesteps", "128", "--eval-episodes", "0",
                      "--compile", "--run-name", "c")
    assert out.returncode == 0, out.stderr[-2000:]
    state = torch.load(tmp_path / "runs/c/ppo_atari_multigpu.model")
    ppo.Agent(4).load_state_dict(state)  # same keys as an uncompiled agent: checkpoints stay portable


def test_kept_memory_serves_the_next_minibatch_without_page_faults():
    # Fresh interpreters: the setting is process-wide. Without it glibc unmaps freed activations
    # and the next minibatch's forward and backward fault their 4 KiB pages in again.
    code = """if 1:
        import resource, sys, torch, ppo_atari_multigpu as ppo
        torch.set_num_threads(1)
        if sys.argv[1] == "keep":
            ppo.keep_freed_memory()
        agent = ppo.Agent(4)
        obs = torch.randint(0, 256, (128, 4, 84, 84), dtype=torch.uint8)
        def faults():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(3):
                agent.get_action_and_value(obs)[3].sum().backward()
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        faults()  # the first minibatch faults its pages in either way
        print(faults())"""
    counts = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        counts[mode] = int(out.stdout.split()[-1])
    assert counts["default"] > 5000, counts  # the problem exists here ...
    assert counts["keep"] < 500, counts  # ... and keep_freed_memory removes it
