"""The optimized default update path against the straightforward computation (CPU)."""

import copy
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import torch.nn as nn
from conftest import ROOT, assert_equal_to_rounding
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries
from torch._dynamo.utils import counters

import ppo_atari_multigpu as ppo


def data(n=64, seed=0):
    """A minibatch by name, as MAIN's `batch`."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        obs=torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
        actions=torch.randint(0, 4, (n,), generator=g),
        logprobs=-1.4 + 0.1 * torch.randn(n, generator=g),
        advantages=torch.randn(n, generator=g),
        returns=torch.randn(n, generator=g),
        values=torch.randn(n, generator=g),
    )


LR = 2.5e-4
CPU = torch.device("cpu")


def new_agent(num_actions=4):
    return ppo.Agent((4, 84, 84), num_actions)


def flat_grad(params):
    """The gradient of every parameter in one vector, in the parameters' logical order."""
    return torch.cat([p.grad.reshape(-1) for p in params])


def straightforward(updates, args, grads=None):
    """CleanRL's way: float observations, fresh .grads, optimizer.zero_grad(), per-tensor Adam.
    `grads`: a list that gets each update's gradient before the clip."""
    torch.manual_seed(0)
    agent = new_agent()
    opt = torch.optim.Adam(agent.parameters(), lr=LR, eps=1e-5)
    for u in range(updates):
        mb = data(seed=u)
        mb["advantages"] = ppo.normalize_advantages(mb["advantages"], 1)
        mb["obs"] = mb["obs"].float()
        coef = ppo.loss_coefficients(args, CPU)
        loss, _ = ppo.ppo_loss(agent, args, coef, mb)
        opt.zero_grad()
        loss.backward()
        if grads is not None:
            grads.append(flat_grad(agent.parameters()))
        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in agent.parameters()])


def optimized(updates, args, grads=None, agent=None):
    """The trainer's path: uint8 observations, grads as views of one flat buffer, foreach Adam."""
    torch.manual_seed(0)
    agent = agent or ppo.speed_up(new_agent(), args)
    params = list(agent.parameters())
    kernel = {"fused": True} if args.compile else {"foreach": True}  # as the trainer
    opt = torch.optim.Adam(params, lr=LR, eps=1e-5, **kernel)
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    buckets = ppo.GradBuckets(params, flat, args.bucket_mb, 1)
    autocast, scaler = ppo.precision(args, CPU)
    coef = ppo.loss_coefficients(args, CPU)
    for u in range(updates):
        batch = data(seed=u)
        inds = torch.arange(len(batch["obs"]))
        ppo.minibatch_gradient(agent, args, coef, batch, inds, buckets, autocast, scaler)
        buckets.wait()  # one rank: nothing to all-reduce
        if grads is not None:
            grads.append(flat_grad(params))
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        scaler.step(opt)
        scaler.update()
    return torch.cat([p.detach().reshape(-1) for p in params])


def upload(array):
    return torch.as_tensor(array, device=CPU)


def gradient(batch, inds, speed_up=True):
    """The trainer's flat buffer after one minibatch (one rank, default flags): the gradient,
    then the loss statistics. speed_up=False: the channels-last model without speed_up's hook."""
    args = ppo.Args()
    torch.manual_seed(0)
    agent = new_agent()
    agent = ppo.speed_up(agent, args) if speed_up else agent.to(memory_format=torch.channels_last)
    flat = ppo.flat_grad_buffer(list(agent.parameters()), len(ppo.LOSS_STATS))
    buckets = ppo.GradBuckets(list(agent.parameters()), flat, args.bucket_mb, 1)
    autocast, scaler = ppo.precision(args, CPU)
    coef = ppo.loss_coefficients(args, CPU)
    ppo.minibatch_gradient(agent, args, coef, batch, inds, buckets, autocast, scaler)
    buckets.wait()
    return flat.clone()


def test_uint8_frames_flat_gradient_buffer_and_foreach_adam_leave_updates_bit_identical():
    # without channels-last: foreach Adam is bit-identical to torch's per-tensor loop
    args = ppo.Args(channels_last=False)
    grads = [], []
    assert torch.equal(optimized(4, args, grads[0]), straightforward(4, args, grads[1]))
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and len(grads[0]) == 4


def test_channels_last_update_differs_from_straightforward_only_by_rounding():
    # channels-last runs other oneDNN kernels, which sum the convolutions' products in another
    # order (which also depends on the ISA and the thread count): the gradient agrees to float
    # rounding. Adam then amplifies rounding for weights whose gradients are ~0 (m / sqrt(v) of
    # two tiny numbers), but no Adam step moves a weight by more than about the learning rate:
    # after one update the weights agree to a small fraction of it (measured: ~1e-4 lr), and
    # the difference after k updates is bounded by k * lr.
    args = ppo.Args(channels_last=True)
    grads = [], []
    one = (optimized(1, args, grads[0]) - straightforward(1, args, grads[1])).abs()
    assert_equal_to_rounding(grads[0][0], grads[1][0])  # measured: <= 4e-7 x the largest entry
    assert one.max() < LR / 100
    four = (optimized(4, args) - straightforward(4, args)).abs()
    assert four.max() <= 4 * LR
    assert (four > LR / 250).float().mean() < 1e-3  # nearly every weight still agrees to rounding


def test_losing_the_gradient_views_is_detected():
    agent = new_agent()
    params = list(agent.parameters())
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    assert ppo.grads_in_buffer(params, flat)
    torch.optim.Adam(params).zero_grad()  # sets every .grad to None
    assert not ppo.grads_in_buffer(params, flat)
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    agent.to(memory_format=torch.channels_last)  # moves the gradients out of the buffer
    assert not ppo.grads_in_buffer(params, flat)


def test_compiled_run_trains_and_saves_a_checkpoint_a_plain_agent_loads(run_trainer, tmp_path):
    # torch.compile's CPU backend (inductor) builds C++: the compiler it runs is $CXX, else g++
    cxx = os.environ.get("CXX", "g++")
    assert shutil.which(cxx), (
        f"--compile needs a C++ compiler and {cxx!r} is not on PATH "
        "(install g++, e.g. apt-get install g++, or set CXX to one)"
    )
    out = run_trainer(
        "--no-cuda",
        "--local-num-envs",
        "2",
        "--num-steps",
        "32",
        "--update-epochs",
        "1",
        "--num-minibatches",
        "2",
        "--total-timesteps",
        "128",
        "--eval-episodes",
        "0",
        "--compile",
        "--run-name",
        "c",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    state = torch.load(tmp_path / "runs/c/ppo_atari_multigpu.model")
    new_agent().load_state_dict(
        state
    )  # same keys as an uncompiled agent: checkpoints stay portable


def test_compile_keeps_one_kernel_cache_per_cpu_capability_and_leaves_a_users_own(
    monkeypatch, tmp_path
):
    # torch 2.13 serves a kernel built under another ATEN_CPU_CAPABILITY from its cache, and
    # the process aborts: the default cache gets the capability in its name
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    own = f"{default_cache_dir()}_{torch.backends.cpu.get_cpu_capability()}"
    for before, after in ((None, own), (default_cache_dir(), own), (str(tmp_path), str(tmp_path))):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        ppo.speed_up(new_agent(), ppo.Args(compile=True))
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == after


def test_kept_memory_settings_serve_large_blocks_from_the_heap_and_keep_them_after_free():
    # What the code controls: glibc accepts both settings, and afterwards a block far above
    # glibc's default mmap threshold comes from the heap (hblks counts the mmapped blocks) and
    # stays there after its free (fordblks: the heap's free bytes; with glibc's default trim
    # threshold the free would give it back). The same block before the settings is the
    # control: mmapped, not kept, so the measurement can tell. How many page faults that saves
    # depends on the machine: benchmark/page_faults.py.
    code = """if 1:
        import ctypes, platform, ppo_atari_multigpu as ppo

        if platform.libc_ver()[0] != "glibc":
            print("not-glibc", ppo.keep_freed_memory())
            raise SystemExit
        libc = ctypes.CDLL("libc.so.6")
        try:
            mallinfo, field = libc.mallinfo2, ctypes.c_size_t  # glibc >= 2.33
        except AttributeError:
            mallinfo, field = libc.mallinfo, ctypes.c_int  # older glibc: the same, as ints

        class MallInfo(ctypes.Structure):
            _fields_ = [(name, field) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        mallinfo.restype = MallInfo
        libc.malloc.restype = ctypes.c_void_p

        def big_block(when):
            size = 64 << 20  # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
            before = mallinfo()
            block = libc.malloc(size)
            mmapped = mallinfo().hblks - before.hblks
            libc.free(ctypes.c_void_p(block))
            print(when, mmapped, mallinfo().fordblks >> 20)  # MiB free in the heap after it

        big_block("default")
        print("set", ppo.keep_freed_memory())
        big_block("kept")"""
    # glibc's malloc as it starts by default: no tunables from this environment, no preload
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}
    if "not-glibc" in lines:
        assert lines["not-glibc"] == ["False"]  # nothing to set: it says so instead of failing
        return
    # kept: after the free the heap holds at least the block's 64 MiB as free space, however
    # much it held before; the control's block went back to the OS
    (mmapped, free), (mmapped_set, free_set) = [
        [int(x) for x in lines[k]] for k in ("default", "kept")
    ]
    assert mmapped == 1 and free < 64, f"glibc's default did not mmap the block: {lines}"
    assert lines["set"] == ["True"] and mmapped_set == 0 and free_set >= 64, lines


def test_minibatch_gathered_from_the_epochs_uploaded_indices_gives_the_numpy_indexed_gradient():
    # The trainer uploads each epoch's permutation once and slices it (on CUDA, indexing with a
    # numpy array would copy and wait on every minibatch), and gathers the frames with
    # index_select: same samples, same gradient as CleanRL's b_obs[mb_inds] with numpy indices.
    batch = data(n=64)
    perm = np.random.default_rng(0).permutation(64)
    picked = {k: x[perm[16:48]] for k, x in batch.items()}
    grads = [gradient(picked, torch.arange(32)), gradient(batch, upload(perm)[16:48])]
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_frames_stored_in_the_weights_layout_give_the_same_gradient_without_a_reorder():
    # The rollout stores frames channels-last when the weights are: the gathered minibatch is
    # already in the convolution's layout, and the gradient is that of plain NCHW frames.
    batch = data(n=64)
    stored = ppo.frame_buffer((16, 4, 4, 84, 84), True, torch.device("cpu"))
    stored.copy_(batch["obs"].view(16, 4, 4, 84, 84))
    frames = stored.reshape(-1, 4, 84, 84)
    assert frames.data_ptr() == stored.data_ptr()  # a view: the update reads the rollout's buffer
    inds = upload(np.random.default_rng(0).permutation(64))[:32]
    gathered = ppo.gather_frames(frames, inds)
    assert torch.equal(gathered, frames[inds])
    assert gathered.is_contiguous(memory_format=torch.channels_last)  # no reorder before conv1
    grads = [gradient(batch | dict(obs=obs), inds) for obs in (batch["obs"], frames)]
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
    plain = ppo.frame_buffer((16, 4, 4, 84, 84), False, torch.device("cpu"))
    assert plain.is_contiguous() and not plain.any()
    plain.copy_(stored)
    gathered = ppo.gather_frames(plain.reshape(-1, 4, 84, 84), inds)
    assert torch.equal(gathered, frames[inds]) and gathered.is_contiguous()


def test_the_nchw_relu_before_flatten_leaves_the_gradient_bit_identical():
    # speed_up turns the last conv's output back to NCHW before its ReLU (a faster backward):
    # values, products and sums are those of the channels-last model without it
    batch = data(n=32)
    inds = torch.arange(32)
    grads = [gradient(batch, inds, speed_up=s) for s in (False, True)]
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_the_fast_path_finds_its_layers_by_role_and_says_once_what_a_network_lacks():
    network = new_agent().network  # nature_cnn: ..., conv3, ReLU, Flatten, fc, ReLU
    flatten, last_activation = ppo.network_roles(network)
    assert flatten is network[6] and last_activation is network[5]
    said = []
    ppo.speed_up(new_agent(), ppo.Args(compile=True), overlap=True, say=said.append)
    assert said == []  # nature_cnn fits every trick
    # an encoder whose Flatten follows a layer with weights, and one without a Flatten
    no_activation = new_agent()
    no_activation.network = nn.Sequential(
        nn.Conv2d(4, 8, 8, stride=4), nn.Flatten(), nn.Linear(8 * 20 * 20, 512)
    )
    assert ppo.network_roles(no_activation.network)[1] is None
    ppo.speed_up(no_activation, ppo.Args(), say=said.append)
    no_flatten = new_agent()
    no_flatten.network = nn.Sequential(nn.Conv2d(4, 8, 84), nn.ReLU())  # never run here
    assert ppo.network_roles(no_flatten.network) == (None, None)
    ppo.speed_up(no_flatten, ppo.Args(compile=True), overlap=True, say=said.append)
    assert len(said) == 2 and all(line.startswith("fast path: ") for line in said)
    assert "no parameter-free layer just before nn.Flatten" in said[0]
    assert "no parameter-free layer" in said[1] and "not one nn.Flatten" in said[1]


def test_the_flatten_is_taken_only_where_it_is_the_one_and_its_feeding_layer_is_used_once():
    # issue 43: a side branch's Flatten or a shared ReLU got the hooks (the first in modules())
    relu = nn.ReLU()
    shared = nn.Sequential(nn.Conv2d(4, 8, 8, stride=4), relu, nn.Conv2d(8, 8, 3), relu)
    shared.append(nn.Flatten())
    assert ppo.network_roles(shared) == (shared[4], None)
    side = nn.Sequential(nn.Sequential(nn.Conv2d(4, 8, 8), nn.ReLU(), nn.Flatten()), nn.Flatten())
    assert ppo.network_roles(side) == (None, None)  # two: which one ends the convolutions?
    said = []
    agent = new_agent()
    agent.network = side
    ppo.speed_up(agent, ppo.Args(compile=True), overlap=True, say=said.append)
    assert len(said) == 1 and "not one nn.Flatten" in said[0]


def test_frames_are_scaled_to_exactly_cleanrls_float_division_for_every_byte_value():
    frames = torch.arange(256, dtype=torch.uint8).repeat(4 * 84 * 84 // 256 + 1)
    frames = frames[: 4 * 84 * 84].view(1, 4, 84, 84).repeat(2, 1, 1, 1)
    for channels_last in (False, True):
        torch.manual_seed(0)
        agent = ppo.speed_up(new_agent(), ppo.Args(channels_last=channels_last))
        with torch.no_grad():
            expected = agent.network(frames.float() / 255.0)
            assert torch.equal(agent.features(frames), expected)
            assert torch.equal(agent.features(frames.float()), expected)


def test_frames_under_amp_reach_the_first_conv_as_the_autocast_cast_of_the_float_division():
    # under --amp, features() converts bytes straight to the autocast dtype: the first conv must see
    # exactly what autocast makes of x.float() / 255 (hence every number downstream is unchanged)
    frames = torch.arange(256, dtype=torch.uint8).repeat(4 * 84 * 84 // 256 + 1)
    frames = frames[: 4 * 84 * 84].view(1, 4, 84, 84).repeat(2, 1, 1, 1)
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        agent = ppo.speed_up(new_agent(), ppo.Args())
        seen = []
        agent.network[0].register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0]))
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            out = agent.features(frames)
            expected = agent.network(frames.float() / 255.0)
        assert seen[0].dtype == dtype and seen[1].dtype == torch.float32
        assert torch.equal(seen[0], (frames.float() / 255.0).to(dtype))
        assert torch.equal(out, expected) and out.abs().sum() > 0


def test_one_step_upload_gives_the_storage_the_values_of_separate_uploads_with_casts():
    rng = np.random.default_rng(0)
    up = ppo.StepUpload(torch.device("cpu"))
    for n in (4, 4, 6):  # the buffer is reused, and made again for another env count
        frames = rng.integers(0, 256, (n, 4, 84, 84), dtype=np.uint8)
        reward = rng.normal(size=n) * 1e3  # float64, as the envs return it: cast as before
        done = rng.random(n) < 0.5
        rewards, dones = torch.zeros(n), torch.zeros(n)
        obs, rewards[:], next_done = up(frames, reward, done)
        dones[:] = next_done
        assert torch.equal(obs, upload(frames)) and obs.dtype == torch.uint8
        expected = torch.zeros(n)
        expected[:] = upload(reward)  # the storage's own float64 -> float32 cast
        assert torch.equal(rewards, expected) and torch.equal(dones, upload(done).float())


def test_compiled_loss_and_policy_step_are_one_graph_each_equal_eager_and_never_recompile():
    eager_grads, grads = [], []
    expected = optimized(3, ppo.Args(), eager_grads)
    torch.manual_seed(0)
    agent = ppo.speed_up(new_agent(), ppo.Args(compile=True))
    start = copy.deepcopy(agent.state_dict())
    frames = torch.randint(0, 256, (4, 4, 84, 84), dtype=torch.uint8)
    torch._dynamo.reset()  # no cache entries and no counts from earlier tests
    counters.clear()
    with torch.no_grad():
        agent.compiled_policy(frames)  # warm-up: the policy step's graph
    optimized(1, ppo.Args(compile=True), agent=agent)  # warm-up: the loss, forward and backward
    # the whole loss (network, frame conversion, statistics) is one compiled frame and one graph,
    # the policy step another: two graphs, no graph break
    policy_step = ppo.Agent.get_action_and_value
    assert [len(cache_entries(f.__code__)) for f in (ppo.ppo_loss, policy_step)] == [1, 1]
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], counters
    agent.load_state_dict(start)  # in place: the same parameters, the eager run's start
    with torch.compiler.set_stance("fail_on_recompile"):  # raises if anything compiles again
        actual = optimized(3, ppo.Args(compile=True), grads, agent=agent)
        with torch.no_grad():
            out = agent.compiled_policy(frames)
    # fused kernels sum in another order: each gradient within 1e-4 of its largest entry
    for got, want in zip(grads, eager_grads):
        assert_equal_to_rounding(got, want, rel=1e-4)
    assert_equal_to_rounding(actual, expected, rel=1e-4)
    with torch.no_grad():
        eager = ppo.Agent.get_action_and_value(agent, frames, out["action"])
    assert_equal_to_rounding(out["logprob"], eager["logprob"], rel=1e-4)
    assert_equal_to_rounding(out["value"], eager["value"], rel=1e-4)


def test_compiled_loss_with_several_ranks_frees_fc_gradient_before_the_conv_backward():
    # GradBuckets sends a bucket once its gradients are accumulated. In one compiled graph they
    # all wait for the whole backward; with `overlap` (several ranks) fc's gradient is in the
    # flat buffer while conv1's is still zero, as in eager, and the numbers stay eager's.
    eager_grads, grads = [], []
    optimized(2, ppo.Args(), eager_grads)
    torch._dynamo.reset()  # dynamo does not guard on module hooks: no graph of another agent
    torch.manual_seed(0)
    agent = ppo.speed_up(new_agent(), ppo.Args(compile=True), overlap=True)
    conv1, fc = agent.network[0].weight, agent.network[7].weight
    conv1_done = []  # at each fc gradient: is conv1's already in the buffer?
    fc.register_post_accumulate_grad_hook(lambda _: conv1_done.append(bool(conv1.grad.any())))
    start = copy.deepcopy(agent.state_dict())
    optimized(1, ppo.Args(compile=True), agent=agent)  # warm-up: compiles the graphs
    agent.load_state_dict(start)
    conv1_done.clear()
    with torch.compiler.set_stance("fail_on_recompile"):  # the break costs no recompilation
        optimized(2, ppo.Args(compile=True), grads, agent=agent)
    assert conv1_done == [False, False]
    for got, want in zip(grads, eager_grads):
        assert_equal_to_rounding(got, want, rel=1e-4)


def test_policy_step_compiles_in_fp32_and_stays_eager_under_amp_on_a_cpu():
    # under --amp autocast casts the weights once per rollout; a compiled step, on every call
    for amp, compiled in (("none", True), ("bf16", False), ("fp16", False)):
        agent = ppo.speed_up(new_agent(), ppo.Args(compile=True, amp=amp))
        assert ("compiled_policy" in vars(agent)) == compiled and "compiled_loss" in vars(agent)
