"""Where one minibatch of the trainer's update spends its time, part by part, fp32 and bf16:
    python benchmark/update_parts.py [--minibatch 128] [--threads 1] [--repeats 25] [--out FILE]
The trainer's own functions on random frames (one rank, no collectives), in its step order:
minibatch_gradient (frames gathered and converted, forward, loss, backward), clip_grad_norm_,
Adam (foreach, as the trainer). Beside them: the frames' gather + conversion alone, the time
oneDNN's primitives report for one minibatch_gradient under ONEDNN_VERBOSE (the convolutions,
with their reorders; in bf16 also the fc's matmuls, which fp32 leaves to MKL), so that the rest
of it is torch's own work (casts, element-wise ops, autograd), and
fused Adam, which the trainer does not use (it rounds differently). Parts run interleaved;
medians are reported."""

import argparse
import contextlib
import importlib.util
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TRAINER = Path(__file__).resolve().parents[1] / "ppo_atari_multigpu.py"


def load_trainer():
    sys.dont_write_bytecode = True  # no __pycache__ in the repo
    spec = importlib.util.spec_from_file_location("ppo_atari_multigpu", TRAINER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def onednn_ms(fn):
    """Run fn once with oneDNN's verbose mode on; the sum of the execution times it reports (ms).
    oneDNN prints from C, so stdout's file descriptor goes to a temp file meanwhile."""
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
        lines = [line.split(",") for line in f if line.startswith("onednn_verbose")]
    return sum(float(fields[-1]) for fields in lines if "exec" in fields)


def parts(mod, dtype, minibatch, repeats):
    """Median ms per part for one dtype ("fp32" or "bf16")."""
    args = mod.Args(amp="bf16" if dtype == "bf16" else "none", local_num_envs=4)
    mod.resolve_sizes(args, 1)
    cpu = torch.device("cpu")
    agent = mod.speed_up(mod.Agent(4), args)  # as the trainer, before the flat buffer
    autocast, scaler = mod.precision(args, cpu)
    params = list(agent.parameters())
    adam = torch.optim.Adam(params, lr=args.learning_rate, eps=1e-5, foreach=True)
    fused = torch.optim.Adam([p.detach().clone() for p in params], lr=1e-4, fused=True)
    for p, q in zip(params, fused.param_groups[0]["params"]):
        q.grad = torch.randn_like(p)
    n_params = sum(p.numel() for p in params)
    flat = mod.flat_grad_buffer(params, len(mod.LOSS_STATS))
    n = 4 * minibatch  # a rollout of 4 minibatches
    frames = mod.frame_buffer((n, 1, 4, 84, 84), args.channels_last, cpu).view(n, 4, 84, 84)
    frames.copy_(torch.randint(0, 256, frames.shape, dtype=torch.uint8))
    batch = (frames, torch.randint(0, 4, (n,)), -torch.rand(n), *torch.randn(3, n))
    inds = torch.randperm(n)[:minibatch]
    first = agent.network[0].weight

    def gradient():
        timer = contextlib.nullcontext()
        mod.minibatch_gradient(agent, args, flat, n_params, batch, inds, 1, autocast, scaler, timer)

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
    times = {k: [] for k in fns}
    for r in range(repeats + 3):  # 3 warm-up rounds: kernel choice, allocator
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            if r >= 3:
                times[k].append(time.perf_counter() - t)
    out = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    out["oneDNN primitives inside it (convolutions; in bf16 also fc)"] = float(
        np.median([onednn_ms(gradient) for _ in range(max(3, repeats // 5))])
    )
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minibatch", type=int, default=128, help="samples per rank per minibatch")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer: 1 per rank)")
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--out", type=Path, help="also write the table to this file")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    mod = load_trainer()
    mod.keep_freed_memory()  # as the trainer
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    lines = [
        f"The trainer's update, one minibatch of {a.minibatch} samples, {a.threads} torch "
        f"thread(s), torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"AMX bf16 {'yes' if 'amx_bf16' in flags else 'no'}; medians of {a.repeats} "
        "interleaved repeats (oneDNN: of its verbose sums).",
        "",
        "| dtype | part | ms |",
        "|---|---|---|",
    ]
    for dtype in ("fp32", "bf16"):
        ms = parts(mod, dtype, a.minibatch, a.repeats)
        step = ["minibatch_gradient", "clip_grad_norm_", "Adam, foreach"]
        total = sum(v for k, v in ms.items() if any(k.startswith(s) for s in step))
        for k, v in ms.items():
            lines.append(f"| {dtype} | {k} | {v:.2f} |")
        lines.append(
            f"| {dtype} | **the trainer's step: gradient + clip + Adam** | **{total:.2f}** |"
        )
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
