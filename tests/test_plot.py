"""Tests for benchmark/plot.py on small synthetic TensorBoard logs with known values."""

import importlib.util
import statistics
from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

import ppo_atari_multigpu as ppo

_spec = importlib.util.spec_from_file_location(
    "benchmark_plot", Path(__file__).resolve().parents[1] / "benchmark" / "plot.py"
)
plot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot)

T0 = 1_700_000_000.0  # explicit wall times, well before the files' real creation time
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_events(run_dir, scalars, suffix=""):
    """scalars: iterable of (tag, step, value, wall_time) written into one new event file."""
    writer = SummaryWriter(str(run_dir), filename_suffix=suffix)
    for tag, step, value, wall in scalars:
        writer.add_scalar(tag, value, step, walltime=wall)
    writer.close()


def write_run(runs_dir, name, returns, sps=(), step_per_episode=100, sec_per_step=0.01):
    """One event file: episode i ends at step (i+1)*step_per_episode; SPS logged per 'iteration'."""
    scalars = []
    for i, ret in enumerate(returns):
        step = (i + 1) * step_per_episode
        scalars.append((plot.RETURN, step, ret, T0 + step * sec_per_step))
    for i, value in enumerate(sps):
        step = (i + 1) * step_per_episode
        scalars.append((plot.SPS, step, value, T0 + step * sec_per_step))
    scalars.sort(key=lambda s: s[1])
    write_events(Path(runs_dir) / name, scalars)


def test_run_name_parsing_keeps_underscores_in_exp_name_and_reads_seed_third():
    assert plot.parse_run_name("BreakoutNoFrameskip-v4__ppo_atari_multigpu__3__1764670000") == (
        "BreakoutNoFrameskip-v4",
        "ppo_atari_multigpu",
        3,
    )
    assert plot.parse_run_name("Pong-v4__a__b_c__1__2") == ("Pong-v4", "a__b_c", 1)
    assert plot.parse_run_name("not_a_run") is None
    assert plot.parse_run_name("Pong-v4__a__1__notastamp") is None


def test_run_names_the_trainer_makes_under_resume_auto_or_in_a_shared_second_are_plotted():
    args = ppo.Args(env_id="Pong-v4", exp_name="my_exp", seed=4, resume="auto")
    auto = ppo.choose_run_name(args)
    assert plot.parse_run_name(auto) == ("Pong-v4", "my_exp", 4)
    assert plot.parse_run_name("Pong-v4__my_exp__4__1764670000-2") == ("Pong-v4", "my_exp", 4)


def test_results_table_mean_and_std_over_seeds_of_last_n_episode_means(tmp_path):
    seed1 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    seed2 = [10, 20, 30, 40, 50, 60]
    write_run(tmp_path, "Pong-v4__my_exp__1__100", seed1, sps=[100, 300, 200])
    write_run(tmp_path, "Pong-v4__my_exp__2__101", seed2, sps=[400, 600, 500, 700])
    rows = plot.summarize(plot.discover_runs(str(tmp_path)), last_n=4)

    expected_means = [statistics.fmean(seed1[-4:]), statistics.fmean(seed2[-4:])]  # 7.5, 45
    (row,) = rows
    assert (row["env_id"], row["exp_name"], row["n_seeds"], row["episodes"]) == (
        "Pong-v4",
        "my_exp",
        2,
        8,
    )
    assert sorted(row["seed_means"]) == pytest.approx(expected_means)
    assert row["return_mean"] == pytest.approx(statistics.fmean(expected_means))  # 26.25
    assert row["return_std"] == pytest.approx(statistics.pstdev(expected_means))  # 18.75
    assert row["sps"] == pytest.approx((200 + 550) / 2)  # mean over seeds of per-run median SPS
    assert row["final_step"] == (600, 1000)
    assert row["minutes"] == pytest.approx(
        (9 + 5) / 60 / 2
    )  # first to last point: 900 and 500 steps * 0.01 s

    table = plot.format_tables(rows, last_n=4)
    assert "| Pong-v4 | my_exp | 26.25 ± 18.75 | 2 | 8 |" in table
    assert "| Pong-v4 | my_exp | 0.1 | 375 | 600–1000 |" in table


def test_resumed_run_drops_superseded_points_and_excludes_downtime_from_elapsed_time(tmp_path):
    run_dir = tmp_path / "Pong-v4__exp__1__100"
    # First process: steps 100..500 (1 s per 100 steps), then crashes; last checkpoint was step 300.
    write_events(run_dir, [(plot.RETURN, s, 1.0, T0 + s / 100) for s in range(100, 600, 100)], ".a")
    # Resumed an hour later at step 300, redoing 300..500 with different values, going on to 700.
    t_resume = T0 + 3600
    # The finished run also logs its final evaluation, indexed by episode (steps 0, 1): that must
    # not count as a restart at step 0.
    write_events(
        run_dir,
        [(plot.RETURN, s, 2.0, t_resume + (s - 300) / 100) for s in range(300, 800, 100)]
        + [("eval/episodic_return", i, 9.0, t_resume + 4) for i in range(2)],
        ".b",
    )
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2

    steps, values, elapsed = plot.load_run(str(run_dir))[plot.RETURN]
    np.testing.assert_array_equal(steps, [100, 200, 300, 400, 500, 600, 700])
    np.testing.assert_array_equal(values, [1, 1, 2, 2, 2, 2, 2])
    # File 1 kept 100..200 (elapsed 0..1 s); file 2 starts its clock where that ended.
    np.testing.assert_allclose(elapsed, [0, 1, 1, 2, 3, 4, 5])

    (row,) = plot.summarize(plot.discover_runs(str(tmp_path)), last_n=100)
    assert row["episodes"] == 7 and row["return_mean"] == pytest.approx(12 / 7)
    assert row["minutes"] == pytest.approx(5 / 60) and row["final_step"] == (700, 700)


def test_run_without_finished_episode_is_reported_and_skipped_in_plot(tmp_path, capsys):
    runs, out = tmp_path / "runs", tmp_path / "out"
    write_run(runs, "Pong-v4__exp__1__100", returns=[], sps=[50, 60, 70])
    write_run(runs, "Breakout-v4__exp__1__100", returns=[1, 2, 3])
    write_run(runs, "Breakout-v4__exp__2__100", returns=[], sps=[10])
    assert plot.main(["--runs-dir", str(runs), "--out-dir", str(out)]) == 0

    table = (out / "results.md").read_text()
    assert table in capsys.readouterr().out
    assert "| Pong-v4 | exp | no finished episode | 1 | 0 |" in table
    assert "| Pong-v4 | exp | 0.0 | 60 | 300 |" in table  # runtime is still reported
    assert "| Breakout-v4 | exp | 2.00 ± 0.00 | 2 (1 with no finished episode) | 3 |" in table
    assert (out / "returns_vs_steps.png").read_bytes().startswith(PNG_MAGIC)


def test_main_writes_valid_png_plots_for_runs_of_different_lengths(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    rng = np.random.default_rng(0)
    for env in ("Pong-v4", "Breakout-v4"):
        for exp in ("ppo_a", "ppo_b"):
            for seed, n in ((1, 30), (2, 45)):
                write_run(
                    runs, f"{env}__{exp}__{seed}__100", rng.normal(size=n).cumsum(), sps=[100] * 5
                )
    assert (
        plot.main(["--runs-dir", str(runs), "--out-dir", str(out), "--exp-names", "ppo_a", "ppo_b"])
        == 0
    )
    for name in ("returns_vs_steps.png", "returns_vs_time.png"):
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    assert (out / "results.md").stat().st_size > 0


def test_mean_curve_grid_stops_at_shortest_seed_and_averages_interpolated_curves():
    short = (np.array([0.0, 10.0]), np.array([0.0, 10.0]))
    long = (np.array([0.0, 20.0]), np.array([2.0, 2.0]))
    grid, mean, lo, hi = plot.mean_curve([short, long], n_points=3)
    np.testing.assert_allclose(grid, [0, 5, 10])
    np.testing.assert_allclose(mean, [1, 3.5, 6])
    np.testing.assert_allclose(lo, [0, 2, 2])
    np.testing.assert_allclose(hi, [2, 5, 10])


@pytest.mark.parametrize("layout", ["missing", "empty", "no_event_files"])
def test_missing_or_empty_runs_dir_returns_2_with_one_line_error(tmp_path, capsys, layout):
    runs = tmp_path / "runs"
    if layout != "missing":
        runs.mkdir()
    if layout == "no_event_files":
        (runs / "Pong-v4__exp__1__100").mkdir()
        (runs / "Pong-v4__exp__1__100" / "notes.txt").write_text("hi")
    assert plot.main(["--runs-dir", str(runs), "--out-dir", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(runs) in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "out").exists()


def write_perf_run(runs_dir, name, per_rank, n_iters=3):
    """per_rank: {rank: {key: [value per iteration]}} for keys rollout, env, update, allreduce."""
    scalars = [(plot.SPS, (i + 1) * 100, 100.0, T0 + i) for i in range(n_iters)]
    for rank, series in per_rank.items():
        for key, values in series.items():
            for i, value in enumerate(values):
                scalars.append((f"perf/{key}_s/rank{rank}", (i + 1) * 100, value, T0 + i))
    write_events(Path(runs_dir) / name, scalars)


def test_time_split_png_has_one_bar_per_rank_from_perf_tags(tmp_path, capsys):
    runs, out = tmp_path / "runs", tmp_path / "out"
    write_perf_run(
        runs,
        "Pong-v4__ddp__1__100",
        {
            0: dict(rollout=[3, 5, 4], env=[2, 3, 1], update=[1, 2, 3], allreduce=[0.5, 0.5, 0.5]),
            1: dict(rollout=[6, 6, 6], env=[4, 4, 4], update=[2, 2, 2], allreduce=[1, 0, 2]),
        },
    )
    split = plot.time_split(plot.load_run(str(runs / "Pong-v4__ddp__1__100")))
    assert list(split) == [0, 1]  # one bar per rank, in rank order
    assert split[0] == pytest.approx(
        {"env": 2, "inference": 4 - 2, "update compute": 2 - 0.5, "all-reduce": 0.5}
    )
    assert split[1] == pytest.approx(
        {"env": 4, "inference": 2, "update compute": 1, "all-reduce": 1}
    )
    assert list(split[0]) == list(plot.PHASES)

    assert plot.main(["--runs-dir", str(runs), "--out-dir", str(out)]) == 0
    data = (out / "time_split.png").read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    assert "time_split.png" in capsys.readouterr().out


def test_time_split_skips_runs_without_perf_tags_and_writes_no_png_if_none_has_them(
    tmp_path, capsys
):
    runs, out = tmp_path / "runs", tmp_path / "out"
    write_run(runs, "Pong-v4__exp__1__100", returns=[1, 2, 3], sps=[100, 200])
    assert plot.time_split(plot.load_run(str(runs / "Pong-v4__exp__1__100"))) == {}
    assert plot.main(["--runs-dir", str(runs), "--out-dir", str(out)]) == 0
    assert (out / "returns_vs_steps.png").exists() and not (out / "time_split.png").exists()
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "time_split.png" in err_lines[0]
    assert "Traceback" not in err_lines[0]

    # a run with perf tags next to one without: only the former gets a panel
    write_perf_run(
        runs,
        "Pong-v4__ddp__1__101",
        {0: dict(rollout=[2], env=[1], update=[1], allreduce=[0])},
        n_iters=1,
    )
    assert plot.plot_time_split(plot.discover_runs(str(runs)), out / "time_split.png") == 1
    assert (out / "time_split.png").read_bytes().startswith(PNG_MAGIC)


# ---- benchmark/long_results.py: the long-run table and the per-hour figure ----
_spec = importlib.util.spec_from_file_location(
    "long_results", Path(__file__).resolve().parents[1] / "benchmark" / "long_results.py"
)
long_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(long_results)


def test_long_run_table_counts_resumes_and_catches_a_step_logged_twice(tmp_path):
    run = tmp_path / "Pong__long__1"
    # a first start to step 300, then a resume from step 200 (its file supersedes 200 on)
    first = [(plot.RETURN, s, -21.0, T0 + s) for s in (100, 200, 300)]
    write_events(run, first + [(plot.SPS, s, 300.0, T0 + s) for s in (100, 200, 300)], ".a")
    again = [(plot.RETURN, s, -20.0, T0 + 1000 + s) for s in (200, 300, 400)]
    write_events(run, again + [(plot.SPS, s, 300.0, T0 + 1000 + s) for s in (200, 300, 400)], ".b")
    table = long_results.long_runs([str(run)], str(tmp_path))
    row = table.splitlines()[-1].split(" | ")
    assert row[1:4] == ["400", "0.06", "1"]  # steps; 200 s: the superseded time not counted
    assert row[-1] == "True |"  # load_run dropped the first file's steps >= 200
    assert (tmp_path / "long_runs.png").read_bytes().startswith(PNG_MAGIC)
    dup = tmp_path / "Pong__dup__1"  # one file that logs step 200 twice
    write_events(dup, [(plot.RETURN, 100, 1.0, T0)] + [(plot.SPS, 200, 1.0, T0)] * 2)
    assert long_results.long_runs([str(dup)], str(tmp_path)).splitlines()[-1].endswith("False |")


def test_hours_to_a_return_are_the_first_step_of_the_rolling_mean_over_the_given_sps(tmp_path):
    # the 20-episode rolling mean of 20 zeros, then 20s reaches 10 at the 10th 20 (episode 30)
    write_run(tmp_path, "Breakout__fast__1__1764670000", [0.0] * 20 + [20.0] * 20)
    write_run(tmp_path, "Breakout__slow__1__1764670000", [0.0] * 40)
    table = long_results.per_hour(str(tmp_path), {"fast": 3000 / 3600, "slow": 1.0}, 10, tmp_path)
    rows = {r.split(" | ")[0][2:]: r.split(" | ") for r in table.splitlines()[2:]}
    assert rows["fast"][3] == "1.00"  # episode 30 ends at step 3000: 3000 / (3000 / 3600 SPS)
    assert rows["slow"][3] == "not reached"
    assert (tmp_path / "returns_vs_hours.png").read_bytes().startswith(PNG_MAGIC)
