"""GAE against a plain per-episode reference on random data with episode ends mid-rollout."""

import numpy as np
import torch

from ppo_atari_multigpu import compute_gae


def reference_gae(rewards, values, starts, last_value, last_start, gamma, lam):
    """Straight from the definition, one env at a time: A_t = sum_k (gamma*lam)^k delta_{t+k},
    where the sum stops at the end of t's episode and delta uses V(s_{t+1}) only inside it."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            total, discount = 0.0, 1.0
            for k in range(t, T):
                ends_here = starts[k + 1, n] if k + 1 < T else last_start[n]
                next_v = 0.0 if ends_here else (values[k + 1, n] if k + 1 < T else last_value[n])
                total += discount * (rewards[k, n] + gamma * next_v - values[k, n])
                if ends_here:
                    break
                discount *= gamma * lam
            adv[t, n] = total
    return adv


def test_gae_matches_per_episode_reference_with_dones_mid_rollout():
    rng = np.random.default_rng(0)
    T, N, gamma, lam = 16, 3, 0.99, 0.95
    rewards, values = rng.normal(size=(T, N)), rng.normal(size=(T, N))
    starts = (rng.random((T, N)) < 0.2).astype(np.float64)
    last_value, last_start = rng.normal(size=N), np.array([1.0, 0.0, 0.0])
    assert starts[1:].sum() > 0  # episode ends inside the rollout are exercised
    adv, ret = compute_gae(
        *(torch.tensor(x) for x in (rewards, values, starts, last_value[None], last_start)),
        gamma,
        lam,
    )
    expected = reference_gae(rewards, values, starts, last_value, last_start, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ret.numpy(), expected + values, rtol=1e-10, atol=1e-10)


def torch_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """The trainer's GAE as torch ops (CleanRL's loop, before it moved to numpy on the host)."""
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(rewards.shape[0])):
        if t == rewards.shape[0] - 1:
            nextnonterminal, nextvalues = 1.0 - next_done, next_value
        else:
            nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


def test_gae_on_the_host_gives_the_torch_loops_float32_numbers_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    T, N = 128, 8  # the trainer's rollout of one rank, float32 as it stores it
    rewards = torch.randint(-1, 2, (T, N), generator=g).float()  # clipped rewards
    values = torch.randn(T, N, generator=g)
    dones = (torch.rand(T, N, generator=g) < 0.05).float()
    next_value, next_done = torch.randn(1, N, generator=g), torch.tensor([1.0] + [0.0] * (N - 1))
    for gamma, lam in ((0.99, 0.95), (0.997, 0.9)):
        flags = (rewards, values, dones, next_value, next_done, gamma, lam)
        adv, ret = compute_gae(*flags)
        ref_adv, ref_ret = torch_gae(*flags)
        assert adv.dtype == torch.float32 and adv.shape == (T, N)
        assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)
