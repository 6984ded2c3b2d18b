"""Two gloo ranks spawned in-process: the flat all-reduce gives the single-process gradient."""

import copy

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from conftest import assert_equal_to_rounding

import ppo_atari_multigpu as ppo

N_ACTIONS, LOCAL = 4, 16  # samples per rank per minibatch


def make_batch(seed, n):
    g = torch.Generator().manual_seed(seed)
    return dict(  # by name, as MAIN's `batch`
        obs=torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
        actions=torch.randint(0, N_ACTIONS, (n,), generator=g),
        logprobs=-1.4 + 0.1 * torch.randn(n, generator=g),
        advantages=torch.randn(n, generator=g),
        returns=torch.randn(n, generator=g),
        values=torch.randn(n, generator=g),
    )


def minibatch_gradient(agent, args, buckets, batch, inds, world_size):
    """The trainer's minibatch step: loss and backward, then the all-reduce's wait."""
    args = copy.copy(args)
    args.world_size = world_size  # as resolve_sizes sets it
    cpu = torch.device("cpu")
    autocast, scaler = ppo.precision(args, cpu)
    coef = ppo.loss_coefficients(args, cpu)
    ppo.minibatch_gradient(agent, args, coef, batch, inds, buckets, autocast, scaler)
    buckets.wait()


class LaunchCount(ppo.GradBuckets):
    """Records how many buckets backward itself had launched when wait() came."""

    def wait(self):
        self.launched_in_backward = len(self.works)
        super().wait()


def gradient(agent, args, batch, world_size, host=None):
    params = list(agent.parameters())
    n_params = sum(p.numel() for p in params)
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    buckets = LaunchCount(params, flat, args.bucket_mb, world_size, args.allreduce_fp16, host)
    inds = torch.arange(len(batch["obs"]))
    minibatch_gradient(agent, args, buckets, batch, inds, world_size)
    assert ppo.grads_in_buffer(params, flat)  # the backward passes wrote into the views
    return flat[:n_params].clone(), buckets.stats.clone(), buckets


def updates(agent, args, rank, world_size):
    """Three real updates on DIFFERENT local data: the parameters, and the KL each rank read."""
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    params = list(agent.parameters())
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    buckets = ppo.GradBuckets(params, flat, args.bucket_mb, world_size)
    kls = []
    for update in range(3):
        batch = make_batch(1000 * update + rank, LOCAL)
        minibatch_gradient(agent, args, buckets, batch, torch.arange(LOCAL), world_size)
        nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        # what the target-kl check reads on this rank
        kls.append(buckets.stats[ppo.LOSS_STATS.index("approx_kl")].item())
    return nn.utils.parameters_to_vector(agent.parameters()).detach().clone(), kls


def worker(rank, world_size, store, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    agent = ppo.Agent((4, 84, 84), N_ACTIONS)  # same seed on both ranks: identical replicas
    args = ppo.Args(grad_accum=1)
    args.minibatch_size = LOCAL * world_size  # as resolve_sizes sets it
    union = make_batch(123, LOCAL * world_size)
    mine = {k: x[rank * LOCAL : (rank + 1) * LOCAL] for k, x in union.items()}
    out = {}
    # --rank-envs 3 1: rank 0 holds 3/4 of the same union, rank 1 the last quarter
    cut = [0, 3 * LOCAL // 2, 2 * LOCAL]
    uneven = {k: x[cut[rank] : cut[rank + 1]] for k, x in union.items()}
    out["uneven"], out["uneven_stats"], _ = gradient(agent, args, uneven, world_size)
    args.grad_accum = 4  # divides each rank's own minibatch
    out["uneven_accum"], _, _ = gradient(agent, args, uneven, world_size)
    args.grad_accum = 1
    out["dist"], out["dist_stats"], buckets = gradient(agent, args, mine, world_size)
    out["buckets"], out["launched_in_backward"] = len(buckets.views), buckets.launched_in_backward
    out["single"], out["single_stats"], _ = gradient(agent, args, union, 1)
    out["host"], out["host_stats"], _ = gradient(agent, args, mine, world_size, host=True)
    args.grad_accum = 4
    out["accum"], _, _ = gradient(agent, args, mine, world_size)
    args.grad_accum, args.allreduce_fp16 = 1, True
    out["fp16"], out["fp16_stats"], _ = gradient(agent, args, mine, world_size)
    out["host_fp16"], _, _ = gradient(agent, args, mine, world_size, host=True)
    args.allreduce_fp16, args.bucket_mb = False, 0.0  # one all-reduce of the buffer after backward
    out["one"], out["one_stats"], buckets = gradient(agent, args, mine, world_size)
    out["one_launched_in_backward"] = buckets.launched_in_backward
    out["one_params"], _ = updates(copy.deepcopy(agent), args, rank, world_size)
    args.bucket_mb = ppo.Args.bucket_mb  # the default: buckets launched during backward
    out["params"], out["kls"] = updates(agent, args, rank, world_size)
    results[rank] = out
    dist.destroy_process_group()


def run_two_ranks(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    return [results[0], results[1]]


_cache = {}


def two_ranks(tmp_path_factory):
    if "r" not in _cache:  # one spawn serves every test in this file
        _cache["r"] = run_two_ranks(tmp_path_factory.mktemp("dist"))
    return _cache["r"]


def test_allreduced_gradient_equals_single_process_gradient(tmp_path_factory):
    r0, r1 = two_ranks(tmp_path_factory)
    assert r0["dist"].abs().sum() > 0
    assert_equal_to_rounding(r0["dist"], r0["single"])  # measured: ~2.5e-7 x the largest entry
    assert_equal_to_rounding(r0["dist_stats"], r0["single_stats"])
    assert torch.equal(r0["dist"], r1["dist"])  # every rank holds the very same average


def test_uneven_ranks_sample_weighted_gradient_equals_single_process_gradient(tmp_path_factory):
    r0, r1 = two_ranks(tmp_path_factory)
    assert_equal_to_rounding(r0["uneven"], r0["single"])  # 24 + 8 samples against the 32
    assert_equal_to_rounding(r0["uneven_stats"], r0["single_stats"])  # the statistics too
    assert_equal_to_rounding(r0["uneven_accum"], r0["single"])
    assert torch.equal(r0["uneven"], r1["uneven"])


def test_grad_accum_gradient_equals_one_micro_batch_gradient(tmp_path_factory):
    r0, r1 = two_ranks(tmp_path_factory)
    assert_equal_to_rounding(r0["accum"], r0["dist"])
    assert_equal_to_rounding(r1["accum"], r1["dist"])


def test_parameters_stay_bit_identical_across_ranks_after_updates(tmp_path_factory):
    r0, r1 = two_ranks(tmp_path_factory)
    assert torch.equal(r0["params"], r1["params"])


def test_buckets_launched_during_backward_give_the_one_all_reduce_bit_for_bit(tmp_path_factory):
    r0, r1 = two_ranks(tmp_path_factory)
    for r in (r0, r1):
        assert r["buckets"] >= 2 and r["launched_in_backward"] >= 1  # it did overlap
        assert r["one_launched_in_backward"] == 0  # --bucket-mb 0: all after backward
        assert torch.equal(r["dist"], r["one"]) and torch.equal(r["dist_stats"], r["one_stats"])
        assert torch.equal(r["params"], r["one_params"])  # after three updates too


def test_fp16_allreduce_rounds_only_the_gradients_and_every_rank_gets_the_same(tmp_path_factory):
    r0, r1 = two_ranks(tmp_path_factory)
    assert torch.equal(r0["fp16"], r1["fp16"])  # the replicas still take the same step
    assert not torch.equal(r0["fp16"], r0["dist"])  # fp16 did travel: the gradients rounded
    # two roundings to fp16 (each rank's half, then their sum): 2**-10 of the larger entries
    scale = r0["dist"].abs().max()
    assert torch.allclose(r0["fp16"], r0["dist"], rtol=2**-10, atol=2**-10 * scale)
    assert torch.equal(r0["fp16_stats"], r0["dist_stats"])  # the statistics stay fp32


def test_target_kl_decision_reads_the_same_rank_averaged_kl_on_every_rank(tmp_path_factory):
    r0, r1 = two_ranks(tmp_path_factory)
    # the local KLs differ (different data); what each rank reads after the all-reduce must not
    assert r0["kls"] == r1["kls"]


def test_buckets_through_host_copies_give_the_same_numbers(tmp_path_factory):
    # the path of gloo with CUDA tensors (ranks sharing a GPU), here with CPU copies
    for r in two_ranks(tmp_path_factory):
        assert torch.equal(r["host"], r["dist"]) and torch.equal(r["host_stats"], r["dist_stats"])
        assert torch.equal(r["host_fp16"], r["fp16"])
