"""What the update's arithmetic costs on this CPU, per layer, for fp32 and bf16:
    python benchmark/update_ceiling.py [--minibatch 128] [--rollout-batch 4] [--threads 1]
        [--peak-size 2048] [--out FILE]
For each layer of the trainer's Agent at one minibatch (channels-last, as the trainer runs it):
(a) the layer's forward + backward as torch runs it (autocast for bf16, as --amp bf16), and
(b) the same arithmetic as plain matrix products of the im2col shapes (forward, input gradient
where the trainer needs one, weight gradient): the best this machine's matmul kernels (oneDNN,
AMX for bf16 where present) do for exactly those shapes. The sum of (b) over layers is a floor
for the update's arithmetic per minibatch; a square 2048 (--peak-size) matmul gives the dtype's
peak.
(c) each convolution rebuilt from torch ops to reach (b): im2col patches (F.unfold), one matmul,
backward by autograd (col2im), inputs and weights already in the dtype: what replacing oneDNN's
convolution by matmuls costs when the patches must be made (fc: a matmul already, as in (a)).
One more row per dtype: the four layers' forward alone (no gradient) at the rollout's batch (the
envs per rank), as the policy runs them at every rollout step, back to back (warm caches): the
rollout's arithmetic floor.
Everything else runs interleaved (A B A B ...); medians are reported.
A second table splits the trainer's own step (its functions, random frames, one rank, no
collectives) in its order: minibatch_gradient (frames gathered and converted, forward, loss,
backward), clip_grad_norm_, Adam (foreach, as the trainer); beside them the frames' gather +
conversion alone, the time oneDNN's primitives report for one minibatch_gradient under
ONEDNN_VERBOSE (the convolutions with their reorders; in bf16 also the fc's matmuls, which fp32
leaves to MKL), so that the rest of it is torch's own work (casts, element-wise ops, autograd),
and fused Adam, which the trainer does not use (it rounds differently). Where oneDNN ran no
primitive (bf16 on a CPU without bf16 instructions, e.g. AVX2 only) that row says "not used on
this CPU" instead of a time."""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from throughput import load_trainer  # this folder: the trainer loaded as a module

ONEDNN_PART = "oneDNN primitives inside it (convolutions; in bf16 also fc)"
NOT_USED = "not used on this CPU"  # that row where oneDNN ran nothing (bf16 on AVX2: torch's own)

# (name, in channels, out channels, kernel, stride, input side) of the Agent's trunk; fc last
CONVS = [("conv1", 4, 32, 8, 4, 84), ("conv2", 32, 64, 4, 2, 20), ("conv3", 64, 64, 3, 1, 9)]
FC = ("fc", 64 * 7 * 7, 512)


def gemm_shapes(batch):
    """Per layer: the (M, K, N) matrix products of forward, input gradient, weight gradient."""
    out = {}
    for i, (name, cin, cout, k, s, side) in enumerate(CONVS):
        m, kk = batch * ((side - k) // s + 1) ** 2, cin * k * k
        shapes = [(m, kk, cout)]  # forward: patches x weights
        if i > 0:  # the first layer's input (the frames) needs no gradient
            shapes.append((m, cout, kk))
        shapes.append((cout, m, kk))  # weight gradient
        out[name] = shapes
    name, fin, fout = FC
    out[name] = [(batch, fin, fout), (batch, fout, fin), (fout, batch, fin)]
    return out


def forward_shapes(batch):
    """The forward product of each layer (the first of gemm_shapes' list)."""
    return [shapes[0] for shapes in gemm_shapes(batch).values()]


def bench(fns, repeats):
    times = {k: [] for k in fns}
    for r in range(repeats + 3):  # 3 warm-up rounds: kernel choice, allocator
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            if r >= 3:
                times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}


def layer_fns(batch, dtype):
    """Each layer's forward + backward as the trainer runs it."""
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    fns = {}
    for i, (name, cin, cout, k, s, side) in enumerate(CONVS):
        x = torch.randn(batch, cin, side, side).contiguous(memory_format=torch.channels_last)
        x.requires_grad_(i > 0)
        conv = torch.nn.Conv2d(cin, cout, k, stride=s).to(memory_format=torch.channels_last)

        def run(x=x, conv=conv):
            with amp:
                y = conv(x)
            y.float().sum().backward()

        fns[name] = run
    name, fin, fout = FC
    x, fc = torch.randn(batch, fin, requires_grad=True), torch.nn.Linear(fin, fout)

    def run_fc():
        with amp:
            y = fc(x)
        y.float().sum().backward()

    fns[name] = run_fc
    return fns


def rollout_fn(batch, dtype):
    """The four layers' forward at the rollout's batch, back to back, without autograd."""
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    convs = [
        torch.nn.Conv2d(cin, cout, k, stride=s).to(memory_format=torch.channels_last)
        for _, cin, cout, k, s, _ in CONVS
    ]
    x = torch.randn(batch, 4, 84, 84).contiguous(memory_format=torch.channels_last)
    fc = torch.nn.Linear(FC[1], FC[2])

    def run():
        with torch.no_grad(), amp:
            y = x
            for conv in convs:
                y = conv(y)
            fc(y.flatten(1))

    return run


def gemm_fns(batch, dtype):
    fns = {}
    for name, shapes in gemm_shapes(batch).items():
        mats = [
            (torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)) for m, k, n in shapes
        ]

        def run(mats=mats):
            for a, b in mats:
                torch.mm(a, b)

        fns[name] = run
    return fns


def im2col_fns(batch, dtype):
    """(c): each conv as unfold + matmul in `dtype`, forward + backward (the input's gradient
    where the trainer needs one, through fold)."""
    fns = {}
    for i, (name, cin, cout, k, s, side) in enumerate(CONVS):
        x = torch.randn(batch, cin, side, side, dtype=dtype, requires_grad=i > 0)
        w = torch.randn(cout, cin * k * k, dtype=dtype, requires_grad=True)
        b, out = torch.randn(cout, 1, dtype=dtype, requires_grad=True), (side - k) // s + 1

        def run(x=x, w=w, b=b, k=k, s=s, out=out):
            y = w @ torch.nn.functional.unfold(x, k, stride=s) + b  # batch x cout x out²
            y.view(batch, -1, out, out).float().sum().backward()

        fns[name] = run
    return fns


def onednn_exec_ms(lines):
    """The sum of the execution times (ms, the last field) of the primitive `exec` lines in
    ONEDNN_VERBOSE output; None when there is none: oneDNN ran nothing (torch sends bf16
    convolutions to oneDNN only where the CPU has bf16 instructions). Skipped: info lines,
    primitive creation (`create:cache_miss`, its last field a creation time), graph lines."""
    total, ran = 0.0, False
    for line in lines:
        fields = line.strip().split(",")
        if fields[0] != "onednn_verbose" or "graph" in fields[1:4]:
            continue
        if "exec" in fields[1:5]:  # v1 format: onednn_verbose,v1,[timestamp,]primitive,exec,...
            total, ran = total + float(fields[-1]), True
    return total if ran else None


def onednn_ms(fn):
    """Run fn once with oneDNN's verbose mode on: onednn_exec_ms of what it prints (None: oneDNN
    ran nothing). oneDNN prints from C, so stdout's file descriptor goes to a temp file
    meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as f:
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return onednn_exec_ms(f)


def parts(mod, dtype, minibatch, repeats):
    """Median ms per part for one dtype ("fp32" or "bf16")."""
    args = mod.Args(amp="bf16" if dtype == "bf16" else "none", local_num_envs=4)
    mod.resolve_sizes(args, 1)
    cpu = torch.device("cpu")
    agent = mod.speed_up(mod.Agent((4, 84, 84), 4), args)  # as the trainer, before the buffer
    autocast, scaler = mod.precision(args, cpu)
    params = list(agent.parameters())
    adam = torch.optim.Adam(params, lr=args.learning_rate, eps=1e-5, foreach=True)
    fused = torch.optim.Adam([p.detach().clone() for p in params], lr=1e-4, fused=True)
    for p, q in zip(params, fused.param_groups[0]["params"]):
        q.grad = torch.randn_like(p)
    flat = mod.flat_grad_buffer(params, len(mod.LOSS_STATS))
    buckets = mod.GradBuckets(params, flat, args.bucket_mb, 1)  # one rank: no collectives
    coef = mod.loss_coefficients(args, cpu)
    n = 4 * minibatch  # a rollout of 4 minibatches
    frames = mod.frame_buffer((n, 1, 4, 84, 84), args.channels_last, cpu).view(n, 4, 84, 84)
    frames.copy_(torch.randint(0, 256, frames.shape, dtype=torch.uint8))
    advantages, returns, values = torch.randn(3, n)
    batch = dict(obs=frames, actions=torch.randint(0, 4, (n,)), logprobs=-torch.rand(n))
    batch |= dict(advantages=advantages, returns=returns, values=values)
    inds = torch.randperm(n)[:minibatch]
    first = agent.network[0].weight

    def gradient():
        mod.minibatch_gradient(agent, args, coef, batch, inds, buckets, autocast, scaler)
        buckets.wait()  # one rank: returns at once

    def convert():
        with autocast:
            mod.network_input(mod.gather_frames(frames, inds), first)

    fns = {
        "minibatch_gradient (frames, forward, loss, backward)": gradient,
        "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm),
        "Adam, foreach (the trainer's)": adam.step,
        "frames alone: gather + convert": convert,
        "Adam, fused (not used: rounds differently)": fused.step,
    }
    out = {k: 1e3 * seconds for k, seconds in bench(fns, repeats).items()}
    runs = [onednn_ms(gradient) for _ in range(max(3, repeats // 5))]
    ran = [ms for ms in runs if ms is not None]
    out[ONEDNN_PART] = float(np.median(ran)) if ran else None  # None: oneDNN ran nothing
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minibatch", type=int, default=128, help="samples per rank per minibatch")
    p.add_argument("--rollout-batch", type=int, default=4, help="envs per rank (rollout batch)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer: 1 per rank)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--peak-size", type=int, default=2048, help="side of the square matmul giving the peak"
    )
    p.add_argument("--out", type=Path, help="also write the table to this file")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    amx = "amx_bf16" in flags
    shapes = gemm_shapes(a.minibatch)
    flop = {n: sum(2 * m * k * nn for m, k, nn in s) for n, s in shapes.items()}
    lines = [
        f"Update arithmetic per minibatch of {a.minibatch} samples, {a.threads} torch thread(s), "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"AMX bf16 {'yes' if amx else 'no'}; medians of {a.repeats} interleaved repeats.",
        "",
        "| dtype | layer | GFLOP | as trained: fwd+bwd ms | GFLOP/s | as matmuls (floor) ms "
        "| GFLOP/s | as im2col + matmul: fwd+bwd ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        layers, gemms = layer_fns(a.minibatch, dtype), gemm_fns(a.minibatch, dtype)
        n = a.peak_size  # bf16 without bf16 instructions (AVX2): 2048 takes ~45 s per product
        sq = torch.randn(n, n, dtype=dtype)
        fns = {("layer", k): f for k, f in layers.items()}
        fns.update({("gemm", k): f for k, f in gemms.items()})
        fns.update({("im2col", k): f for k, f in im2col_fns(a.minibatch, dtype).items()})
        fns[("peak", n)] = lambda sq=sq: torch.mm(sq, sq)
        t = bench(fns, a.repeats)
        total_l = total_g = total_i = 0.0
        for name in layers:
            tl, tg, g = t[("layer", name)], t[("gemm", name)], flop[name] / 1e9
            ti = t.get(("im2col", name), tl)  # fc: the trained layer is a matmul already
            total_l, total_g, total_i = total_l + tl, total_g + tg, total_i + ti
            lines.append(
                f"| {label} | {name} | {g:.2f} | {1e3 * tl:.1f} | {g / tl:.0f} "
                f"| {1e3 * tg:.1f} | {g / tg:.0f} | {1e3 * ti:.1f} |"
            )
        g = sum(flop.values()) / 1e9
        lines.append(
            f"| {label} | **all layers** | {g:.2f} | **{1e3 * total_l:.1f}** | {g / total_l:.0f} "
            f"| **{1e3 * total_g:.1f}** | {g / total_g:.0f} | **{1e3 * total_i:.1f}** |"
        )
        peak = 2 * n**3 / 1e9 / t[("peak", n)]
        lines.append(
            f"| {label} | {n}² matmul (peak) | {2 * n**3 / 1e9:.1f} | | | | {peak:.0f} | |"
        )
        # back to back, not interleaved: the update-sized runs would evict its weights each time
        tr = bench({"rollout": rollout_fn(a.rollout_batch, dtype)}, 20 * a.repeats)["rollout"]
        g = a.rollout_batch * sum(2 * m * k * n for m, k, n in forward_shapes(1)) / 1e9
        lines.append(
            f"| {label} | rollout forward, batch {a.rollout_batch} (forward ms) | {g:.3f} "
            f"| {1e3 * tr:.2f} | {g / tr:.0f} | | | |"
        )
    mod = load_trainer()
    mod.keep_freed_memory()  # as the trainer
    lines += [
        "",
        "The trainer's own step, part by part, one minibatch (its functions; medians, oneDNN: "
        "of its verbose sums):",
        "",
        "| dtype | part | ms |",
        "|---|---|---|",
    ]
    for dtype in ("fp32", "bf16"):
        ms = parts(mod, dtype, a.minibatch, a.repeats)
        step = ["minibatch_gradient", "clip_grad_norm_", "Adam, foreach"]
        total = sum(v for k, v in ms.items() if any(k.startswith(s) for s in step))
        lines += [
            f"| {dtype} | {k} | {NOT_USED if v is None else f'{v:.2f}'} |" for k, v in ms.items()
        ]
        lines.append(
            f"| {dtype} | **the trainer's step: gradient + clip + Adam** | **{total:.2f}** |"
        )
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
