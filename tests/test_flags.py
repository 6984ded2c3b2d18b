"""Batch-size flags: every consistent subset resolves to the same table; others are refused."""

import pytest

from ppo_atari_multigpu import Args, resolve_sizes


def resolve(world_size=1, **flags):
    return resolve_sizes(Args(**flags), world_size)


def test_defaults_are_cleanrl_sizes_per_rank():
    a = resolve(world_size=2)
    assert (a.local_num_envs, a.num_envs, a.num_steps) == (8, 16, 128)
    assert (a.local_batch_size, a.batch_size) == (1024, 2048)
    assert (a.num_minibatches, a.local_minibatch_size, a.minibatch_size) == (4, 256, 512)
    assert a.num_iterations == 10_000_000 // 2048


def test_global_num_envs_is_split_over_ranks():
    a = resolve(world_size=2, num_envs=8)
    assert (a.local_num_envs, a.num_envs, a.local_batch_size) == (4, 8, 512)


def test_local_batch_size_derives_num_steps():
    a = resolve(local_batch_size=256)
    assert (a.local_num_envs, a.num_steps) == (8, 32)


def test_local_batch_size_and_num_steps_derive_local_num_envs():
    a = resolve(local_batch_size=256, num_steps=64)
    assert (a.local_num_envs, a.num_steps) == (4, 64)


def test_local_minibatch_size_derives_num_minibatches():
    a = resolve(local_batch_size=256, local_minibatch_size=64)
    assert (a.num_minibatches, a.local_minibatch_size) == (4, 64)


def test_num_iterations_counts_whole_global_rollouts():
    a = resolve(world_size=2, local_num_envs=4, num_steps=128, total_timesteps=40960)
    assert (a.batch_size, a.num_iterations) == (1024, 40)


@pytest.mark.parametrize(
    "world_size, flags, words",
    [
        (2, dict(num_envs=7), ["--num-envs 7", "world size 2"]),
        (2, dict(num_envs=8, local_num_envs=3), ["--num-envs 8", "--local-num-envs 3"]),
        (1, dict(local_batch_size=100), ["--local-batch-size 100", "--local-num-envs 8"]),
        (
            1,
            dict(local_batch_size=256, local_num_envs=8, num_steps=64),
            ["--local-batch-size 256", "--num-steps 64"],
        ),
        (
            1,
            dict(local_minibatch_size=100),
            ["--local-minibatch-size 100", "--local-batch-size 1024"],
        ),
        (
            1,
            dict(local_minibatch_size=256, num_minibatches=8),
            ["--num-minibatches 8", "--local-minibatch-size 256"],
        ),
        (1, dict(num_minibatches=3), ["--num-minibatches 3", "1024"]),
        (1, dict(grad_accum=3), ["--grad-accum 3", "256"]),
        (2, dict(total_timesteps=1000), ["--total-timesteps 1000", "2048"]),
        (1, dict(local_num_envs=0), ["--local-num-envs", "0"]),
    ],
)
def test_inconsistent_sizes_are_refused_with_a_message_naming_flags_and_numbers(
    world_size, flags, words
):
    with pytest.raises(ValueError) as err:
        resolve(world_size, **flags)
    for word in words:
        assert word in str(err.value)


def test_rank_envs_give_each_rank_its_sizes_and_the_same_minibatch_count():
    ranks = [resolve_sizes(Args(rank_envs=[6, 2], num_steps=32), 2, rank) for rank in (0, 1)]
    assert [(a.local_num_envs, a.local_batch_size, a.local_minibatch_size) for a in ranks] == [
        (6, 192, 48),
        (2, 64, 16),
    ]
    for a in ranks:  # the global sizes are the same on every rank
        assert (a.num_envs, a.batch_size, a.num_minibatches, a.minibatch_size) == (8, 256, 4, 64)
    even = resolve_sizes(Args(rank_envs=[4, 4], num_steps=32), 2, 1)
    plain = resolve(world_size=2, local_num_envs=4, num_steps=32)
    assert {**vars(even), "rank_envs": None} == vars(plain)  # an even split is today's run


@pytest.mark.parametrize(
    "flags, words",
    [
        (dict(rank_envs=[4, 2, 2]), ["--rank-envs 4 2 2", "one count per rank", "world size 2"]),
        (dict(rank_envs=[8, 0]), ["--rank-envs 8 0", "at least 1 env"]),
        (dict(rank_envs=[6, 2], num_envs=6), ["--rank-envs 6 2", "--num-envs 6"]),
        (dict(rank_envs=[6, 2], local_num_envs=4), ["--rank-envs", "drop --local-num-envs"]),
        (dict(rank_envs=[6, 1], num_steps=2), ["--num-minibatches 4", "rank 1", "1 envs x 2"]),
        (dict(rank_envs=[6, 2], grad_accum=3), ["--grad-accum 3", "rank 1", "2 envs x 128"]),
    ],
)
def test_rank_envs_that_do_not_fit_are_refused_naming_the_flag_and_the_numbers(flags, words):
    for rank in (0, 1):  # the same verdict on every rank
        with pytest.raises(ValueError) as err:
            resolve_sizes(Args(**flags), 2, rank)
        for word in words:
            assert word in str(err.value)
