"""Plot and tabulate PPO Atari runs from their TensorBoard logs.

    python benchmark/plot.py --runs-dir runs --out-dir benchmark/results \
        [--exp-names a b] [--last-n 100]

Run directories are named as the trainer names them: f"{env_id}__{exp_name}__{seed}__{suffix}",
the suffix a unix timestamp (with "-2", "-3"... when two launches share a second) or, with
--resume auto, "cfg" and ten hex digits. Writes returns_vs_steps.png, returns_vs_time.png and
results.md into --out-dir, and time_split.png (mean seconds per iteration of each rank, split by
phase) if runs logged perf/*.
"""

import argparse
import glob
import math
import os
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

RETURN, SPS = "charts/episodic_return", "charts/SPS"
EVENT_GLOB = "events.out.tfevents.*"
PERF_TAG = re.compile(r"perf/(rollout|env|update|allreduce)_s/rank(\d+)")
PHASES = ("env", "inference", "update compute", "all-reduce")  # bottom to top of each bar
RUN_SUFFIX = re.compile(r"\d+(-\d+)?|cfg[0-9a-f]{10}")  # the trainer's choose_run_name
MAX_SPLIT_PANELS = 6


def parse_run_name(name):
    """(env_id, exp_name, seed) from 'env__exp__seed__suffix', or None if it does not match.
    Only env is taken from the front and seed/suffix from the back, so exp_name may contain
    underscores (even double ones)."""
    parts = name.split("__")
    if len(parts) < 4 or not (parts[-2].isdigit() and RUN_SUFFIX.fullmatch(parts[-1])):
        return None
    return parts[0], "__".join(parts[1:-2]), int(parts[-2])


def load_run(run_dir):
    """{tag: (steps, values, elapsed_seconds)} for one run, chaining all its event files.

    A resumed run has one event file per (re)start. A file that starts at step S supersedes every
    point of the earlier files at step >= S (that work was redone after the crash). Elapsed time
    restarts where the previous file's kept data ended, so downtime between files is not counted."""
    files = []
    for path in glob.glob(os.path.join(run_dir, EVENT_GLOB)):
        # purge_orphaned_data=False: we do the cross-file supersession ourselves, explicitly.
        acc = EventAccumulator(path, size_guidance={"scalars": 0}, purge_orphaned_data=False)
        acc.Reload()
        scalars = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
        events = [e for evs in scalars.values() for e in evs]
        if not events:  # writer opened, process died before logging anything
            continue
        first_wall = min(e.wall_time for e in events)
        # The file's first event is written when the writer opens, so starting the clock there
        # also counts the first iteration; min() guards against files whose scalars carry
        # explicit wall times earlier than the file's creation.
        t0 = min(acc.FirstEventTimestamp(), first_wall)
        # eval/* is indexed by evaluation episode, not global step: it says nothing about restarts
        restart_step = min(
            (e.step for tag, evs in scalars.items() if not tag.startswith("eval/") for e in evs),
            default=math.inf,
        )
        files.append((first_wall, path, restart_step, t0, scalars))
    files.sort(key=lambda f: f[:2])  # file names are only second-resolution: order by wall time

    cols = defaultdict(lambda: ([], [], []))
    offset = 0.0
    for i, (_, _, _, t0, scalars) in enumerate(files):
        cutoff = min((f[2] for f in files[i + 1 :]), default=math.inf)
        end = offset
        for tag, events in scalars.items():
            steps, values, elapsed = cols[tag]
            for e in events:
                if e.step < cutoff:
                    steps.append(e.step)
                    values.append(e.value)
                    elapsed.append(offset + e.wall_time - t0)
                    end = max(end, elapsed[-1])
        offset = end
    out = {}
    for tag, (steps, values, elapsed) in cols.items():
        if steps:
            order = np.argsort(steps, kind="stable")  # keeps episode order within one step
            out[tag] = (
                np.asarray(steps, np.int64)[order],
                np.asarray(values, float)[order],
                np.asarray(elapsed, float)[order],
            )
    return out


def discover_runs(runs_dir, exp_names=None):
    """List of {name, env_id, exp_name, seed, data}; searched recursively so that env ids with a
    '/' (e.g. ALE/Breakout-v5, which nests the run dir) still work. Raises ValueError if none."""
    if not os.path.isdir(runs_dir):
        raise ValueError(f"runs dir '{runs_dir}' does not exist or is not a directory")
    event_files = glob.glob(os.path.join(runs_dir, "**", EVENT_GLOB), recursive=True)
    run_dirs = sorted({os.path.dirname(p) for p in event_files})
    if not run_dirs:
        raise ValueError(f"no TensorBoard event files ({EVENT_GLOB}) found under '{runs_dir}'")
    runs = []
    for run_dir in run_dirs:
        name = os.path.relpath(run_dir, runs_dir).replace(os.sep, "/")
        parsed = parse_run_name(name)
        if parsed is None:
            msg = f"warning: skipping '{name}': not named env__exp__seed__suffix"
            print(msg, file=sys.stderr)
        elif exp_names is None or parsed[1] in exp_names:
            runs.append(
                dict(
                    name=name,
                    env_id=parsed[0],
                    exp_name=parsed[1],
                    seed=parsed[2],
                    data=load_run(run_dir),
                )
            )
    if not runs:
        raise ValueError(
            f"no matching runs under '{runs_dir}'"
            + (f" for --exp-names {' '.join(exp_names)}" if exp_names else "")
        )
    return runs


def group_runs(runs):
    groups = defaultdict(list)
    for run in runs:
        groups[(run["env_id"], run["exp_name"])].append(run)
    return dict(sorted(groups.items()))


def summarize(runs, last_n=100):
    """One row (dict) per (env_id, exp_name) with the return and runtime statistics."""
    rows = []
    for (env_id, exp_name), group in group_runs(runs).items():
        seeds = [r["seed"] for r in group]
        if len(set(seeds)) < len(seeds):
            print(
                f"warning: {env_id} {exp_name}: seed repeated in {seeds}, each run counts as one",
                file=sys.stderr,
            )
        tails = [r["data"][RETURN][1][-last_n:] for r in group if RETURN in r["data"]]
        means = [float(t.mean()) for t in tails]
        finals = [max(int(s[-1]) for s, _, _ in r["data"].values()) for r in group if r["data"]]
        minutes = [
            max(float(t.max()) for _, _, t in r["data"].values()) / 60 for r in group if r["data"]
        ]
        sps = [float(np.median(r["data"][SPS][1])) for r in group if SPS in r["data"]]
        rows.append(
            dict(
                env_id=env_id,
                exp_name=exp_name,
                n_seeds=len(group),
                seed_means=means,
                return_mean=float(np.mean(means)) if means else None,
                return_std=float(np.std(means)) if means else None,  # population std (ddof=0)
                episodes=sum(len(t) for t in tails),
                no_episode_runs=len(group) - len(means),
                minutes=float(np.mean(minutes)) if minutes else None,
                sps=float(np.mean(sps)) if sps else None,
                final_step=(min(finals), max(finals)) if finals else None,
            )
        )
    return rows


def format_tables(rows, last_n):
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"## Episodic return (mean of each seed's last {last_n} episodes; "
        "mean ± std over seeds, ddof=0)",
        "",
        "| Game | Variant | Return | Seeds | Episodes counted |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ret = (
            "no finished episode"
            if r["return_mean"] is None
            else f"{r['return_mean']:.2f} ± {r['return_std']:.2f}"
        )
        seeds = str(r["n_seeds"])
        if r["no_episode_runs"] and r["return_mean"] is not None:
            seeds += f" ({r['no_episode_runs']} with no finished episode)"
        lines.append(f"| {r['env_id']} | {r['exp_name']} | {ret} | {seeds} | {r['episodes']} |")
    lines += [
        "",
        "## Runtime (mean over seeds; SPS = mean of each run's median charts/SPS)",
        "",
        "| Game | Variant | Elapsed training time (min) | SPS | Final global step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lo_hi = r["final_step"]
        step = (
            "n/a"
            if lo_hi is None
            else (str(lo_hi[0]) if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}–{lo_hi[1]}")
        )
        lines.append(
            f"| {r['env_id']} | {r['exp_name']} | {fmt(r['minutes'], '.1f')} | "
            f"{fmt(r['sps'], '.0f')} | {step} |"
        )
    return "\n".join(lines) + "\n"


def rolling_mean(values, window):
    """Trailing mean over up to `window` episodes (shorter at the start instead of dropping it)."""
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    start = np.maximum(idx - window, 0)
    return (csum[idx] - csum[start]) / (idx - start)


def mean_curve(curves, n_points=200):
    """(grid, mean, min, max) of several (x, y) curves, interpolated onto the x range that every
    curve covers (so it stops at the shortest seed's end and never extrapolates); None if
    disjoint."""
    lo, hi = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
    if hi < lo:
        return None
    grid = np.linspace(lo, hi, n_points) if hi > lo else np.array([lo], float)
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def plot_returns(runs, out_path, x_axis="steps", smooth=20):
    groups = group_runs(runs)
    envs = sorted({env for env, _ in groups})
    ncols = min(3, len(envs))
    nrows = math.ceil(len(envs) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    for ax, env in zip(axes.flat, envs):
        for (g_env, exp), group in groups.items():
            curves = []
            for run in group:
                if g_env == env and RETURN in run["data"]:
                    steps, values, elapsed = run["data"][RETURN]
                    curves.append(
                        (steps if x_axis == "steps" else elapsed / 60, rolling_mean(values, smooth))
                    )
            band = mean_curve(curves) if curves else None
            if band is not None:
                grid, mean, lo, hi = band
                (line,) = ax.plot(
                    grid,
                    mean,
                    marker="o" if len(grid) == 1 else None,
                    label=f"{exp} ({len(curves)} seeds)",
                )
                ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.2)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no finished episode", transform=ax.transAxes, ha="center")
        ax.set_title(env)
        ax.set_xlabel("global step" if x_axis == "steps" else "elapsed training time (min)")
        ax.set_ylabel(f"episodic return (rolling mean, {smooth} ep.)")
    for ax in axes.flat[len(envs) :]:
        ax.set_visible(False)
    fig.suptitle("mean over seeds; shaded band: min–max over seeds")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def time_split(data):
    """{rank: {phase: mean seconds per iteration}} from one run's load_run() data, phases as in
    PHASES: env = env_s, inference = rollout_s - env_s, update compute = update_s - allreduce_s,
    all-reduce = allreduce_s. Each tag is averaged over its iterations; a rank missing any of the
    four perf tags is left out, so a run without perf tags gives {}."""
    means = defaultdict(dict)
    for tag, (_, values, _) in data.items():
        match = PERF_TAG.fullmatch(tag)
        if match:
            means[int(match[2])][match[1]] = float(values.mean())
    return {
        rank: {
            "env": m["env"],
            "inference": m["rollout"] - m["env"],
            "update compute": m["update"] - m["allreduce"],
            "all-reduce": m["allreduce"],
        }
        for rank, m in sorted(means.items())
        if len(m) == 4
    }


def plot_time_split(runs, out_path):
    """One panel per run with perf tags (the first MAX_SPLIT_PANELS), one stacked bar per rank.
    Returns the number of panels drawn; writes nothing if that is 0."""
    splits = [(run["name"], time_split(run["data"])) for run in runs]
    splits = [(name, split) for name, split in splits if split]
    if len(splits) > MAX_SPLIT_PANELS:
        skipped = len(splits) - MAX_SPLIT_PANELS
        print(
            f"note: time_split.png shows the first {MAX_SPLIT_PANELS} runs with perf tags; "
            f"skipped {skipped}",
            file=sys.stderr,
        )
        splits = splits[:MAX_SPLIT_PANELS]
    if not splits:
        return 0
    ncols = min(3, len(splits))
    nrows = math.ceil(len(splits) / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(5 * ncols, 3.6 * nrows + 0.6), squeeze=False, layout="constrained"
    )
    for ax, (name, split) in zip(axes.flat, splits):
        ranks = list(split)
        bottom = np.zeros(len(ranks))
        for phase in PHASES:
            seconds = np.array([split[r][phase] for r in ranks])
            bars = ax.bar(range(len(ranks)), seconds, bottom=bottom, label=phase)
            bottom += seconds
        ax.bar_label(bars, labels=[f"{t:.3g} s" for t in bottom], padding=2, fontsize=8)
        ax.set_ylim(0, 1.15 * max(bottom.max(), 1e-9))  # room for the totals above the bars
        ax.set_xlim(-1, len(ranks))  # a lone rank's bar is not stretched over the whole panel
        ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("rank")
        ax.set_ylabel("seconds per iteration")
    for ax in axes.flat[len(splits) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    # one legend for all panels, below them, in stacking order (bottom of the bar first)
    fig.legend(handles, labels, loc="outside lower center", ncols=len(PHASES))
    fig.suptitle("time split per rank: mean seconds per iteration (label: total)")
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return len(splits)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--out-dir", default="benchmark/results")
    parser.add_argument("--exp-names", nargs="+", default=None, help="only these variants")
    parser.add_argument("--last-n", type=int, default=100, help="episodes per seed in the table")
    parser.add_argument(
        "--smooth", type=int, default=20, help="rolling-mean window (episodes) for plots"
    )
    args = parser.parse_args(argv)
    if args.last_n < 1 or args.smooth < 1:
        parser.error("--last-n and --smooth must be >= 1")  # a[-0:] would silently mean "all"
    try:
        runs = discover_runs(args.runs_dir, args.exp_names)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    table = format_tables(summarize(runs, args.last_n), args.last_n)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(table)
    print(table)
    for x_axis, fname in (("steps", "returns_vs_steps.png"), ("time", "returns_vs_time.png")):
        plot_returns(runs, os.path.join(args.out_dir, fname), x_axis, args.smooth)
    written = "results.md, returns_vs_steps.png, returns_vs_time.png"
    if plot_time_split(runs, os.path.join(args.out_dir, "time_split.png")):
        written += ", time_split.png"
    else:
        print("note: no run has perf/* time tags; time_split.png not written", file=sys.stderr)
    print(f"wrote {written} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
