"""What torch.compile buys for each piece of the trainer's step, eager against compiled, in one
process on this machine (the trainer's own Agent, ppo_loss and optimizer settings):
    python benchmark/compile_pieces.py [--threads 1] [--envs 4] [--minibatch 256]
        [--precisions fp32 bf16] [--repeats 30] [--host HOST]
Pieces: the rollout's policy step (Agent.get_action_and_value on `envs` frames, as the
trainer's compiled_policy, sampling inside the compiled graph or outside it), the update's loss +
backward of one minibatch, and the clip + Adam step (compiled, or eager with fused Adam). And
when the gradient hooks fire in the loss's backward (GradBuckets launches its all-reduces from
them): the first as a fraction of the backward's time.
Median milliseconds after warm-up, the compiled/eager ratio and the compile seconds. Writes a
markdown table to stdout and to benchmark/results/compile-pieces-<host>.md."""

import argparse
import datetime
import shlex
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import load_trainer  # noqa: E402

N_ACTIONS = 4  # Breakout's
OBS_SHAPE = (4, 84, 84)  # the trainer's default --frame-stack 4 of 84x84 frames


def compare(eager, compiled, repeats):
    """(eager median ms, compiled median ms, seconds of the compiled first call): 3 warm-up calls
    each, then `repeats` calls of each, alternated, so the machine's drift hits both alike."""
    t = time.perf_counter()
    compiled()
    first = time.perf_counter() - t
    for _ in range(2):
        compiled()
    for _ in range(3):
        eager()
    times = ([], [])
    for _ in range(repeats):
        for fn, out in zip((eager, compiled), times):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return 1000 * float(np.median(times[0])), 1000 * float(np.median(times[1])), first


def pieces(mod, a, amp):
    """{piece: {"eager": ms, "compiled": ms, "compile_s": s}} for one precision."""
    torch._dynamo.reset()
    args = mod.Args(amp=amp)
    torch.manual_seed(0)
    agent = mod.speed_up(mod.Agent(OBS_SHAPE, N_ACTIONS), args)
    params = list(agent.parameters())
    flat = mod.flat_grad_buffer(params, len(mod.LOSS_STATS))
    optimizer = torch.optim.Adam(params, lr=args.learning_rate, eps=1e-5, foreach=True)
    autocast, _ = mod.precision(args, torch.device("cpu"))
    coef = mod.loss_coefficients(args, torch.device("cpu"))
    frames = torch.randint(0, 256, (a.envs, *OBS_SHAPE), dtype=torch.uint8)
    frames = frames.contiguous(memory_format=torch.channels_last)
    n = a.minibatch
    obs = torch.randint(0, 256, (n, *OBS_SHAPE), dtype=torch.uint8)
    obs = obs.contiguous(memory_format=torch.channels_last)
    actions = torch.randint(0, N_ACTIONS, (n,))
    with torch.no_grad(), autocast:
        out = agent.get_action_and_value(obs, actions)
    logprobs, values = out["logprob"], out["value"].flatten()
    adv = torch.randn(n)
    batch = dict(obs=obs, actions=actions, logprobs=logprobs, advantages=adv)
    batch |= dict(returns=values + adv, values=values)

    def heads(x):  # the policy step's network part; sampling then eager
        features = agent.features(x)
        with torch.autocast("cpu", enabled=False):
            return agent.actor(features), agent.critic(features)

    compiled_heads = torch.compile(heads, dynamic=False)
    # the trainer's agent.compiled_policy (speed_up under --compile)
    compiled_policy = torch.compile(agent.get_action_and_value, dynamic=False)

    def policy_outside(x):
        logits, value = compiled_heads(x)
        probs = mod.Categorical(logits=logits, validate_args=False)
        action = probs.sample()
        return dict(
            action=action, logprob=probs.log_prob(action), entropy=probs.entropy(), value=value
        )

    def policy(fn):
        def run():
            with torch.no_grad(), autocast:
                fn(frames)

        return run

    compiled_loss = torch.compile(mod.ppo_loss, dynamic=False)
    compiled_forward = torch.compile(agent.get_action_and_value, dynamic=False)

    def backward(loss_fn, forward=None):
        def run():
            flat.zero_()
            if forward is not None:  # the loss eager around a compiled network + heads
                agent.get_action_and_value = forward
            with autocast:
                loss, _ = loss_fn(agent, args, coef, batch)
            loss.backward()
            agent.__dict__.pop("get_action_and_value", None)

        return run

    def clip_step():
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()

    compiled_step = torch.compile(clip_step)
    fused = torch.optim.Adam(params, lr=args.learning_rate, eps=1e-5, fused=True)

    def fused_step():  # eager, one fused kernel: what the trainer takes under --compile
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        fused.step()

    fired = []  # the bucket all-reduces start from these hooks in the trainer
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(time.perf_counter()))

    def first_hook(run):
        """Median over 5 calls of (first hook - backward start) / backward time (warm)."""
        fractions = []
        for _ in range(6):
            fired.clear()
            t = time.perf_counter()
            run()
            fractions.append((min(fired) - t) / (time.perf_counter() - t))
        return float(np.median(fractions[1:]))

    backward(mod.ppo_loss)()  # gradients for the step to use
    out = {
        "first gradient hook, fraction of loss + backward": {
            "eager": first_hook(backward(mod.ppo_loss)),
            "compiled": first_hook(backward(compiled_loss)),
        }
    }
    for name, eager, variants in (
        (
            "policy step, sampling inside",
            policy(agent.get_action_and_value),
            policy(compiled_policy),
        ),
        (
            "policy step, sampling outside",
            policy(agent.get_action_and_value),
            policy(policy_outside),
        ),
        (
            f"loss + backward ({n}), all compiled (--compile)",
            backward(mod.ppo_loss),
            backward(compiled_loss),
        ),
        (
            f"loss + backward ({n}), get_action_and_value compiled",
            backward(mod.ppo_loss),
            backward(mod.ppo_loss, compiled_forward),
        ),
        ("clip + Adam step (foreach), compiled", clip_step, compiled_step),
        ("clip + Adam step, fused Adam instead (eager)", clip_step, fused_step),
    ):
        eager_ms, compiled_ms, first = compare(eager, variants, a.repeats)
        out[name] = {"eager": eager_ms, "compiled": compiled_ms, "compile_s": first}
        print(f"{amp} {name}: {eager_ms:.2f} -> {compiled_ms:.2f} ms", file=sys.stderr)
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (a 2 x 4 run: 1)")
    p.add_argument("--envs", type=int, default=4, help="frames per policy step (one rank's envs)")
    p.add_argument("--minibatch", type=int, default=256, help="samples per loss + backward")
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--host", default=socket.gethostname(), help="names the results file")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    mod = load_trainer()
    sys.modules["ppo_atari_multigpu"] = mod  # dynamo imports the module of what it traces
    mod.keep_freed_memory()  # as the trainer does: no page faults on each call's fresh buffers
    started = datetime.datetime.now().astimezone()
    results = {prec: pieces(mod, a, "none" if prec == "fp32" else prec) for prec in a.precisions}
    md = [
        f"# torch.compile per piece: ppo_atari_multigpu.py on {a.host}",
        "",
        f"- date: {started:%Y-%m-%d %H:%M %Z}; torch {torch.__version__}, "
        f"{a.threads} thread(s), cpu capability {torch.backends.cpu.get_cpu_capability()}",
        "- command: `python benchmark/compile_pieces.py "
        + " ".join(shlex.quote(x) for x in sys.argv[1:])
        + "`",
        f"- median of {a.repeats} calls each, eager and compiled alternated, after 3 warm-up"
        " calls; compile s = the compiled first call",
        "",
        "| precision | piece | eager ms | compiled ms | compiled / eager | compile s |",
        "|---|---|---|---|---|---|",
    ]
    for prec, rows in results.items():
        for name, r in rows.items():
            if "compile_s" not in r:  # the hook timing: a fraction, not milliseconds
                md.append(f"| {prec} | {name} | {r['eager']:.2f} | {r['compiled']:.2f} | – | – |")
                continue
            md.append(
                f"| {prec} | {name} | {r['eager']:.2f} | {r['compiled']:.2f} |"
                f" {r['compiled'] / r['eager']:.2f} | {r['compile_s']:.1f} |"
            )
    text = "\n".join(md) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / f"compile-pieces-{a.host}.md"
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
