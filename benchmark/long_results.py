"""The README's long-run evidence, from TensorBoard event files:

python benchmark/long_results.py long RUN_DIR [RUN_DIR ...] --out-dir DIR
    returns vs steps of each long run (rolling mean of 100 episodes) with its resume points
    marked, and a table: steps reached, training hours, resumes, last-100 mean, and whether
    every step was logged exactly once (long_runs.md, long_runs.png in DIR)
python benchmark/long_results.py per-hour --runs-dir DIR --sps EXP=SPS [EXP=SPS ...]
    --reach R --out-dir DIR
    returns vs hours of each EXP's seeds, its steps turned into hours at the SPS given (a
    speed measured with the machine to itself: the runs' own wall times are only as fair as
    the load they shared), and per seed the hours until the rolling mean first reached R
    (per_hour.md, returns_vs_hours.png in DIR)
"""

import argparse
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot  # noqa: E402  (benchmark/plot.py: the event-file reader and the rolling mean)

RETURN, SPS = plot.RETURN, plot.SPS


def resume_steps(run_dir):
    """The first step of every event file but the first: where the run was resumed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    firsts = []
    for path in glob.glob(os.path.join(run_dir, plot.EVENT_GLOB)):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        steps = [e.step for tag in acc.Tags()["scalars"] if tag == SPS for e in acc.Scalars(tag)]
        if steps:
            firsts.append(min(steps))
    return sorted(firsts)[1:]


def reached(steps, values, level, window):
    """The first step at which the rolling mean of `window` episodes is >= level, else None."""
    smooth = plot.rolling_mean(values, window)
    hit = np.flatnonzero(smooth >= level)
    return int(steps[hit[0]]) if len(hit) else None


def long_runs(run_dirs, out_dir, window=100):
    import matplotlib.pyplot as plt

    rows = [
        "| run | steps reached | training hours | resumes | mean of last 100 episodes "
        "| each step logged once |",
        "|---|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    for run_dir in run_dirs:
        data, name = plot.load_run(run_dir), os.path.basename(os.path.normpath(run_dir))
        steps, values, elapsed = data[RETURN]
        sps_steps = data[SPS][0]
        once = len(np.unique(sps_steps)) == len(sps_steps)
        resumes = resume_steps(run_dir)
        (line,) = ax.plot(steps, plot.rolling_mean(values, window), label=name)
        for step in resumes:
            ax.axvline(step, color=line.get_color(), linestyle=":", linewidth=1)
        hours = max(float(t.max()) for _, _, t in data.values()) / 3600
        rows.append(
            f"| {name} | {int(sps_steps.max()):,} | {hours:.2f} | {len(resumes)} "
            f"| {values[-window:].mean():.2f} | {once} |"
        )
    ax.set_xlabel("global step (dotted: resumed from a checkpoint)")
    ax.set_ylabel(f"episodic return (rolling mean, {window} ep.)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "long_runs.png"), dpi=100)
    return "\n".join(rows) + "\n"


def per_hour(runs_dir, sps, level, out_dir, window=20):
    import matplotlib.pyplot as plt

    rows = [
        f"| variant | SPS used | seed | hours to a rolling mean ({window} ep.) of {level} "
        "| the run's own wall hours to it |",
        "|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    runs = plot.discover_runs(runs_dir, list(sps))
    for (env_id, exp), group in plot.group_runs(runs).items():
        curves = []
        for run in sorted(group, key=lambda r: r["seed"]):
            steps, values, elapsed = run["data"][RETURN]
            hours = steps / sps[exp] / 3600
            curves.append((hours, plot.rolling_mean(values, window)))
            step = reached(steps, values, level, window)
            at = "not reached" if step is None else f"{step / sps[exp] / 3600:.2f}"
            own = "–" if step is None else f"{elapsed[np.searchsorted(steps, step)] / 3600:.2f}"
            rows.append(f"| {exp} | {sps[exp]:.0f} | {run['seed']} | {at} | {own} |")
        grid, mean, lo, hi = plot.mean_curve(curves)
        (line,) = ax.plot(grid, mean, label=f"{exp} at {sps[exp]:.0f} SPS ({len(curves)} seeds)")
        ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.2)
    ax.axhline(level, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("hours (steps / SPS measured alone)")
    ax.set_ylabel(f"episodic return (rolling mean, {window} ep.)")
    ax.set_title(env_id)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "returns_vs_hours.png"), dpi=100)
    return "\n".join(rows) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("long")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out-dir", required=True)
    p = sub.add_parser("per-hour")
    p.add_argument("--runs-dir", required=True)
    p.add_argument("--sps", nargs="+", required=True, help="EXP=SPS, e.g. ddp_2x4=300")
    p.add_argument("--reach", type=float, default=10.0)
    p.add_argument("--out-dir", required=True)
    a = parser.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    if a.what == "long":
        table, name = long_runs(a.run_dirs, a.out_dir), "long_runs.md"
    else:
        sps = {k: float(v) for k, v in (item.split("=", 1) for item in a.sps)}
        table, name = per_hour(a.runs_dir, sps, a.reach, a.out_dir), "per_hour.md"
    with open(os.path.join(a.out_dir, name), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
