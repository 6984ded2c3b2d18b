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
