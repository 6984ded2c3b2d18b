"""Minor page faults of the trainer's forward+backward, with and without keep_freed_memory():
    python benchmark/page_faults.py [--out benchmark/results/page-faults-<host>.md]
Each mode runs in a fresh interpreter (the allocator settings are process-wide): one torch
thread, the trainer's Agent((4, 84, 84), 4), a uint8 batch of 128x4x84x84, one warm-up pass,
then the minor page faults (ru_minflt) of 3 forward+backward passes. Prints a markdown table and
the C library version; the counts depend on that library's allocator, so this is a measurement,
not a test."""

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

from throughput import REPO, load_trainer  # this folder is on sys.path when run as a script

MODES = ["default", "keep"]  # the C library's own settings; keep_freed_memory()


def worker(mode):
    """Runs in the child process; prints one JSON line."""
    import resource

    import torch

    torch.set_num_threads(1)
    ppo = load_trainer()
    accepted = ppo.keep_freed_memory() if mode == "keep" else None
    agent = ppo.Agent((4, 84, 84), 4)  # Breakout: 4 actions, the default --frame-stack 4
    obs = torch.randint(0, 256, (128, 4, 84, 84), dtype=torch.uint8)

    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            agent.get_action_and_value(obs)["value"].sum().backward()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults()  # warm-up: first-touch faults of weights, gradients and caches
    print(json.dumps({"faults": faults(), "accepted": accepted}), flush=True)


def measure(mode):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"{mode}: worker failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, help="also write the table to this file")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker)

    lines = [
        "# Minor page faults of the trainer's forward+backward",
        "",
        "| mode | minor page faults, 3 forward+backward passes |",
        "|---|---|",
    ]
    libc, version = platform.libc_ver()
    labels = {"default": f"{libc or 'C library'} defaults", "keep": "keep_freed_memory()"}
    notes = []
    for mode in MODES:
        result = measure(mode)
        lines.append(f"| {labels[mode]} | {result['faults']} |")
        if result["accepted"] is not None:
            notes.append(f"keep_freed_memory() returned {result['accepted']}")
    lines += [
        "",
        f"C library: {libc or 'unknown'} {version}; "
        + "; ".join(notes)
        + ". Agent((4, 84, 84), 4), uint8 "
        "batch 128×4×84×84, 1 thread, after one warm-up pass; each mode in a fresh interpreter.",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
        print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
