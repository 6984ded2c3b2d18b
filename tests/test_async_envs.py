"""--async-envs: the double-buffered rollout collects exactly what the plain rollout collects."""

import numpy as np
import pytest
import torch
from conftest import TINY, scalar_tags

import ppo_atari_multigpu as ppo
from ppo_atari_multigpu import merge_infos


def test_merge_infos_concatenates_groups_and_fills_missing_keys_with_zeros():
    a = {
        "lives": np.array([3, 2]),
        "_lives": np.array([True, True]),
        "final_info": {"episode": {"r": np.array([0.0, 7.0])}, "_episode": np.array([False, True])},
    }
    b = {"lives": np.array([5, 5, 4]), "_lives": np.array([True, True, True])}
    out = merge_infos([a, b], [2, 3])
    assert out["lives"].tolist() == [3, 2, 5, 5, 4]
    assert out["final_info"]["episode"]["r"].tolist() == [0.0, 7.0, 0.0, 0.0, 0.0]
    assert out["final_info"]["_episode"].tolist() == [False, True, False, False, False]


@pytest.mark.parametrize("backend", ["sync", "native"])
def test_async_envs_collect_the_same_samples_as_plain_rollouts(run_trainer, tmp_path, backend):
    # Same seeds and the same weights during the rollout: the two env groups must play the very
    # games the single group plays. Only the rounding of values / log-probs differs (the policy
    # runs on half batches, which take other conv kernels), so the weights agree to rounding.
    for name, flags in (("plain", []), ("async", ["--async-envs"])):
        out = run_trainer(
            *TINY,
            "--local-num-envs",
            "4",
            "--num-steps",
            "128",
            "--total-timesteps",
            "1024",
            "--eval-episodes",
            "0",
            "--env-backend",
            backend,
            "--run-name",
            name,
            *flags,
        )
        assert out.returncode == 0, out.stderr[-2000:]
    plain, asynchronous = (scalar_tags(tmp_path / f"runs/{n}") for n in ("plain", "async"))
    assert len(plain["charts/episodic_return"]) >= 2
    for tag in ("charts/episodic_return", "charts/episodic_length"):
        assert asynchronous[tag] == plain[tag]
    a, b = (torch.load(tmp_path / f"runs/{n}/ppo_atari_multigpu.model") for n in ("plain", "async"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_async_sync_backend_starts_env_workers_with_forkserver_not_fork():
    # fork would copy a process that may already run CUDA/NCCL threads
    args = ppo.resolve_sizes(ppo.Args(local_num_envs=2, async_envs=True, total_timesteps=256), 1)
    envs = ppo.RankEnvs(args, "t", False)
    try:
        kinds = {type(p).__name__ for env in envs.envs for p in env.processes}
        assert kinds == {"ForkServerProcess"}
    finally:
        envs.close()
