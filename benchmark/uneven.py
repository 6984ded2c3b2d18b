"""One slow rank, on one machine (needs taskset):
    python benchmark/uneven.py [--loads hog none] [--splits equal 5,3 6,2 auto]
        [--repeats 2] [--iterations 30] [--host HOST]
Two torchrun nodes on loopback (static rendezvous, so node k is rank k), one rank each, pinned
to a core of its own with taskset. "hog" runs a CPU-bound process on rank 1's core, so rank 1
runs at about half speed; "none" leaves the machine alone. A split is the trainer's env counts
of the 8 envs: "equal" (4 + 4, the default), "A,B" (`--rank-envs A B`) or "auto"
(`--balance-envs`). Runs alternate (load x split, then again in reverse order), so drift and
position hit every row alike.
Writes a markdown table (SPS after warm-up, x the equal split under the same load, the split
at the end, each rank's busy seconds per iteration, the imbalance) to stdout and to
benchmark/results/uneven-<host>.md; progress on stderr. The hog is stopped at the end, on an
error and on Ctrl-C / SIGTERM."""

import argparse
import datetime
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slow_link import kill  # noqa: E402
from throughput import (  # noqa: E402
    NUM_STEPS,
    TRAINER,
    WARMUP_ITERS,
    error_line,
    fmt_range,
)

NUM_ENVS = 8
HOG = "while True: pass"


def split_flags(split):
    """'equal' -> [], 'auto' -> ['--balance-envs'], '5,3' -> ['--rank-envs', '5', '3']."""
    if split == "equal":
        return []
    if split == "auto":
        return ["--balance-envs"]
    counts = split.split(",")
    if len(counts) != 2 or not all(c.isdigit() and int(c) >= 1 for c in counts):
        raise argparse.ArgumentTypeError(f"a split is equal, auto or A,B (two counts), not {split}")
    if sum(map(int, counts)) != NUM_ENVS:
        raise argparse.ArgumentTypeError(f"split {split} does not sum to {NUM_ENVS} envs")
    return ["--rank-envs", *counts]


def read_uneven(logdir):
    """SPS after warm-up (from the wall times of consecutive charts/SPS events), each rank's
    busy seconds per iteration, the imbalance and the env split of every iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    values = {tag: np.array([e.value for e in acc.Scalars(tag)]) for tag in acc.Tags()["scalars"]}
    wall = np.array([e.wall_time for e in acc.Scalars("charts/SPS")])
    iter_s = np.diff(wall)[WARMUP_ITERS - 1 :]
    if len(iter_s) == 0:
        raise ValueError(f"too few iterations to skip {WARMUP_ITERS} warm-up ones")
    busy = [
        values[f"perf/rollout_s/rank{r}"]
        + values[f"perf/update_s/rank{r}"]
        - values[f"perf/allreduce_s/rank{r}"]
        for r in (0, 1)
    ]
    splits = np.stack([values["perf/envs/rank0"], values["perf/envs/rank1"]], axis=1)
    return {
        "sps": NUM_ENVS * NUM_STEPS * len(iter_s) / iter_s.sum(),
        "busy": [b[WARMUP_ITERS:] for b in busy],
        "imbalance": values["perf/imbalance"][WARMUP_ITERS:],
        "splits": splits.astype(int),
    }


def run_pair(split, rep, load, a, cores, tmp, port):
    """One two-node run: read_uneven's answer, or {"error": ...}."""
    run_name = f"uneven-{load}-{split.replace(',', '_')}-{rep}"
    procs = []
    for node in (0, 1):
        cmd = ["taskset", "-c", str(cores[node]), sys.executable, "-m", "torch.distributed.run"]
        cmd += ["--nnodes=2", "--nproc_per_node=1", f"--node-rank={node}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={port}"]
        cmd += [str(TRAINER), "--env-id", a.env_id, "--num-envs", str(NUM_ENVS), "--no-cuda"]
        cmd += ["--total-timesteps", str(a.iterations * NUM_ENVS * NUM_STEPS), "--threads", "1"]
        cmd += ["--eval-episodes", "0", "--save-interval", "0", "--run-name", run_name]
        cmd += split_flags(split)
        procs.append(
            subprocess.Popen(
                cmd, cwd=tmp, env=dict(os.environ, PYTHONUNBUFFERED="1"), text=True,
                start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
        )  # fmt: skip
    a.running = procs
    outs, deadline = [], time.time() + a.timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1, deadline - time.time())))
    except subprocess.TimeoutExpired:
        kill(procs)
        return {"error": f"timed out after {a.timeout:.0f} s"}
    finally:
        a.running = []
    try:
        if any(p.returncode for p in procs):
            return {"error": error_line("\n".join(err for _, err in outs))}
        result = read_uneven(Path(tmp, "runs", run_name))
        result["moves"] = [line for line in outs[0][0].splitlines() if line.startswith("envs ")]
        return result
    except Exception as e:  # exited 0 but logged nothing usable
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(Path(tmp, "runs", run_name), ignore_errors=True)


def report(a, results, started, cores):
    """The markdown table. results: {(load, split): [read_uneven answers over repeats]}."""
    md = [
        f"# One slow rank: ppo_atari_multigpu.py on {a.host}",
        "",
        f"- date: {started:%Y-%m-%d %H:%M %Z}, took {(time.time() - started.timestamp()) / 60:.1f}"
        f" min; {a.repeats} repeat(s), alternated; {a.iterations} iterations per run, the first"
        f" {WARMUP_ITERS} skipped",
        f"- 2 nodes x 1 rank on loopback, {NUM_ENVS} envs in all (global batch"
        f" {NUM_ENVS * NUM_STEPS}), rank k pinned to core {cores[0]} / {cores[1]}, `--threads 1`,"
        f" env {a.env_id}, CPU, gloo; load hog: `python -c '{HOG}'` pinned to rank 1's core",
        "- command: `python benchmark/uneven.py "
        + " ".join(shlex.quote(x) for x in sys.argv[1:])
        + "`",
        "",
        "| load | split | SPS median | SPS min–max | × equal¹ | split at the end² |"
        " busy s rank 0 / 1³ | imbalance³ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for load in a.loads:
        base = [r.get("sps") for r in results.get((load, "equal"), [])]
        for split in a.splits:
            runs = results.get((load, split), [])
            ok = [r for r in runs if "sps" in r]
            if not runs:
                continue  # not measured under this load
            if not ok:
                errors = "; ".join(r["error"] for r in runs if "error" in r)
                md.append(f"| {load} | {split} | failed: {errors} | | | | | |")
                continue
            sps = [r["sps"] for r in ok]
            ratio = "–"
            if base and all(base) and len(base) == len(ok) == len(runs):
                per = [s / b for s, b in zip(sps, base)]
                ratio = f"{np.median(sps) / np.median(base):.2f} ({fmt_range(per, 2)})"
            ends = sorted({" + ".join(map(str, r["splits"][-1])) for r in ok})
            busy = [np.median(np.concatenate([r["busy"][k] for r in ok])) for k in (0, 1)]
            imb = np.median(np.concatenate([r["imbalance"] for r in ok]))
            md.append(
                f"| {load} | {split} | {np.median(sps):.0f} | {fmt_range(sps)} | {ratio} |"
                f" {', '.join(ends)} | {busy[0]:.2f} / {busy[1]:.2f} | {imb:.2f} |"
            )
    moves = [(k, r["moves"]) for k, runs in results.items() for r in runs if r.get("moves")]
    md += [
        "",
        "¹ SPS median / the SPS median of the equal split under the same load, both from this"
        " invocation; in brackets the min–max of the per-repeat ratios.",
        "² rank 0 + rank 1 envs in the last iteration (one entry per distinct ending).",
        "³ Medians over the iterations after warm-up, pooled over repeats. Busy = rollout +"
        " update − the time waiting in collectives; imbalance = the slowest rank's busy time"
        " over the mean (perf/imbalance).",
        "",
        "Moves made by `--balance-envs` (rank 0's lines):",
        "",
        *[f"- {load}, repeat run: {'; '.join(lines)}" for (load, _), lines in moves],
    ]
    return "\n".join(md) + "\n"


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--loads", nargs="+", choices=["hog", "none"], default=["hog", "none"])
    p.add_argument("--splits", nargs="+", default=["equal", "5,3", "6,2", "auto"])
    p.add_argument("--unloaded-splits", nargs="+", default=["equal", "auto"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--iterations", type=int, default=30, help="iterations per run (1,024 steps)")
    p.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    p.add_argument("--host", default=socket.gethostname(), help="names the results file")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    a = p.parse_args()
    for split in {*a.splits, *a.unloaded_splits}:
        try:
            split_flags(split)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    if shutil.which("taskset") is None:
        sys.exit("uneven.py needs taskset (util-linux)")
    usable = sorted(os.sched_getaffinity(0))
    cores = (usable[0], usable[1 % len(usable)])

    def stop(signum, frame):
        raise KeyboardInterrupt  # cleaned up below, as for Ctrl-C

    signal.signal(signal.SIGTERM, stop)
    a.running, results, started = [], {}, datetime.datetime.now().astimezone()
    tmp, hog, port = tempfile.mkdtemp(prefix="ppo-uneven-"), None, 29600
    try:
        for rep in range(a.repeats):
            for load in a.loads:
                if load == "hog":
                    cmd = ["taskset", "-c", str(cores[1]), sys.executable, "-c", HOG]
                    hog = subprocess.Popen(cmd, start_new_session=True)
                splits = a.splits if load == "hog" else a.unloaded_splits
                for split in splits if rep % 2 == 0 else splits[::-1]:  # ABBA: no order bias
                    port += 1  # a fresh rendezvous port each run: no TIME_WAIT clashes
                    r = run_pair(split, rep, load, a, cores, tmp, port)
                    results.setdefault((load, split), []).append(r)
                    said = f"{r['sps']:.0f} SPS {r['moves']}" if "sps" in r else r["error"]
                    print(f"repeat {rep + 1}: {load} {split}: {said}", file=sys.stderr, flush=True)
                if hog:
                    hog.kill()
                    hog.wait()
                    hog = None
    except KeyboardInterrupt:
        kill(a.running)
        print("interrupted: partial table below", file=sys.stderr)
    finally:
        if hog:
            hog.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    a.splits = list(dict.fromkeys([*a.splits, *a.unloaded_splits]))
    md = report(a, results, started, cores)
    print(md)
    out = Path(__file__).resolve().parent / "results" / f"uneven-{a.host}.md"
    out.write_text(md)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
