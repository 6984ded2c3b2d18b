"""The optimized default update path against the straightforward computation (CPU)."""

import contextlib
import subprocess
import sys

import numpy as np
import torch
import torch.nn as nn
from conftest import ROOT

import ppo_atari_multigpu as ppo


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (n, 4, 84, 84), generator=g, dtype=torch.uint8),
        torch.randint(0, 4, (n,), generator=g),
        -1.4 + 0.1 * torch.randn(n, generator=g),
        torch.randn(n, generator=g),
        torch.randn(n, generator=g),
        torch.randn(n, generator=g),
    )


def straightforward(updates, args):
    """CleanRL's way: float observations, fresh .grads, optimizer.zero_grad(), per-tensor Adam."""
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
    """The trainer's path: uint8 observations, grads as views of one flat buffer, foreach Adam."""
    torch.manual_seed(0)
    agent = ppo.speed_up(ppo.Agent(4), args)
    params = list(agent.parameters())
    opt = torch.optim.Adam(params, lr=2.5e-4, eps=1e-5, foreach=True)
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    n_params = flat.numel() - len(ppo.LOSS_STATS)
    autocast, scaler = ppo.precision(args, torch.device("cpu"))
    for u in range(updates):
        batch = data(seed=u)
        inds = torch.arange(len(batch[0]))
        ppo.minibatch_gradient(
            agent, args, flat, n_params, batch, inds, 1, autocast, scaler, contextlib.nullcontext()
        )
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        scaler.step(opt)
        scaler.update()
    return torch.cat([p.detach().reshape(-1) for p in params])


def upload(array):
    return ppo.upload(array, torch.device("cpu"))


def gradient(batch, inds, speed_up=True):
    """The trainer's flat buffer after one minibatch (one rank, default flags): the gradient,
    then the loss statistics. speed_up=False: the channels-last model without speed_up's hook."""
    args = ppo.Args()
    torch.manual_seed(0)
    agent = ppo.Agent(4)
    agent = ppo.speed_up(agent, args) if speed_up else agent.to(memory_format=torch.channels_last)
    flat = ppo.flat_grad_buffer(list(agent.parameters()), len(ppo.LOSS_STATS))
    n_params = flat.numel() - len(ppo.LOSS_STATS)
    autocast, scaler = ppo.precision(args, torch.device("cpu"))
    timer = contextlib.nullcontext()
    ppo.minibatch_gradient(agent, args, flat, n_params, batch, inds, 1, autocast, scaler, timer)
    return flat.clone()


def test_uint8_frames_flat_gradient_buffer_and_foreach_adam_leave_updates_bit_identical():
    # without channels-last: foreach Adam is bit-identical to torch's per-tensor loop
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


def test_losing_the_gradient_views_is_detected():
    agent = ppo.Agent(4)
    params = list(agent.parameters())
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    assert ppo.grads_in_buffer(params, flat)
    torch.optim.Adam(params).zero_grad()  # sets every .grad to None
    assert not ppo.grads_in_buffer(params, flat)
    flat = ppo.flat_grad_buffer(params, len(ppo.LOSS_STATS))
    agent.to(memory_format=torch.channels_last)  # moves the gradients out of the buffer
    assert not ppo.grads_in_buffer(params, flat)


def test_compiled_run_trains_and_saves_a_checkpoint_a_plain_agent_loads(run_trainer, tmp_path):
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
    ppo.Agent(4).load_state_dict(
        state
    )  # same keys as an uncompiled agent: checkpoints stay portable


def test_kept_memory_settings_serve_large_blocks_from_the_heap():
    # What the code controls: glibc accepts both settings, and afterwards a block far above
    # glibc's default mmap threshold comes from the heap (mallinfo2's hblks counts the mmapped
    # blocks). How many page faults that saves depends on the machine: benchmark/page_faults.py.
    code = """if 1:
        import ctypes, platform, ppo_atari_multigpu as ppo

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        if platform.libc_ver()[0] != "glibc":
            print("not-glibc", ppo.keep_freed_memory())
            raise SystemExit
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        libc.malloc.restype = ctypes.c_void_p
        print("set", ppo.keep_freed_memory())
        before = libc.mallinfo2().hblks
        block = libc.malloc(64 << 20)  # 64 MiB: above glibc's largest dynamic threshold (32 MiB)
        print("mmapped", libc.mallinfo2().hblks - before)
        libc.free(ctypes.c_void_p(block))"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split() for line in out.stdout.splitlines())
    if "not-glibc" in lines:
        assert lines["not-glibc"] == "False"  # nothing to set: it says so instead of failing
        return
    assert lines == {"set": "True", "mmapped": "0"}


def test_minibatch_gathered_from_the_epochs_uploaded_indices_gives_the_numpy_indexed_gradient():
    # The trainer uploads each epoch's permutation once and slices it (on CUDA, indexing with a
    # numpy array would copy and wait on every minibatch), and gathers the frames with
    # index_select: same samples, same gradient as CleanRL's b_obs[mb_inds] with numpy indices.
    batch = data(n=64)
    perm = np.random.default_rng(0).permutation(64)
    picked = tuple(x[perm[16:48]] for x in batch)
    grads = [gradient(picked, torch.arange(32)), gradient(batch, upload(perm)[16:48])]
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_frames_stored_in_the_weights_layout_give_the_same_gradient_without_a_reorder():
    # The rollout stores frames channels-last when the weights are: the gathered minibatch is
    # already in the convolution's layout, and the gradient is that of plain NCHW frames.
    batch = data(n=64)
    stored = ppo.frame_buffer((16, 4, 4, 84, 84), True, torch.device("cpu"))
    stored.copy_(batch[0].view(16, 4, 4, 84, 84))
    frames = stored.reshape(-1, 4, 84, 84)
    assert frames.data_ptr() == stored.data_ptr()  # a view: the update reads the rollout's buffer
    inds = upload(np.random.default_rng(0).permutation(64))[:32]
    gathered = ppo.gather_frames(frames, inds)
    assert torch.equal(gathered, frames[inds])
    assert gathered.is_contiguous(memory_format=torch.channels_last)  # no reorder before conv1
    grads = [gradient((obs,) + batch[1:], inds) for obs in (batch[0], frames)]
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


def test_frames_are_scaled_to_exactly_cleanrls_float_division_for_every_byte_value():
    frames = torch.arange(256, dtype=torch.uint8).repeat(4 * 84 * 84 // 256 + 1)
    frames = frames[: 4 * 84 * 84].view(1, 4, 84, 84).repeat(2, 1, 1, 1)
    for channels_last in (False, True):
        torch.manual_seed(0)
        agent = ppo.speed_up(ppo.Agent(4), ppo.Args(channels_last=channels_last))
        with torch.no_grad():
            expected = agent.network(frames.float() / 255.0)
            assert torch.equal(agent.hidden(frames), expected)
            assert torch.equal(agent.hidden(frames.float()), expected)


def test_frames_under_amp_reach_the_first_conv_as_the_autocast_cast_of_the_float_division():
    # under --amp, hidden() converts bytes straight to the autocast dtype: the first conv must see
    # exactly what autocast makes of x.float() / 255 (hence every number downstream is unchanged)
    frames = torch.arange(256, dtype=torch.uint8).repeat(4 * 84 * 84 // 256 + 1)
    frames = frames[: 4 * 84 * 84].view(1, 4, 84, 84).repeat(2, 1, 1, 1)
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        agent = ppo.speed_up(ppo.Agent(4), ppo.Args())
        seen = []
        agent.network[0].register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0]))
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            out = agent.hidden(frames)
            expected = agent.network(frames.float() / 255.0)
        assert seen[0].dtype == dtype and seen[1].dtype == torch.float32
        assert torch.equal(seen[0], (frames.float() / 255.0).to(dtype))
        assert torch.equal(out, expected) and out.abs().sum() > 0
