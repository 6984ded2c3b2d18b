"""Seeing a run: time shares, load imbalance, the progress line's cadence, and out-of-memory."""

import subprocess
import time

import torch
from conftest import PG_TIMEOUT, SCRIPT, TINY, torchrun

import ppo_atari_multigpu as ppo


def test_time_shares_split_the_iteration_into_four_parts():
    times = {"rollout": 3.0, "env": 2.0, "update": 5.0, "allreduce": 1.0}
    shares = ppo.time_shares(times)
    assert shares == {"env": 0.25, "inference": 0.125, "update": 0.5, "allreduce": 0.125}


def test_imbalance_is_the_slowest_busy_time_over_the_mean_and_names_that_rank():
    assert ppo.load_imbalance([1.0, 1.0, 2.0, 1.0]) == (1.6, 2)
    assert ppo.load_imbalance([3.0, 3.0]) == (1.0, 0)


def progress(print_every=10.0):
    args = ppo.resolve_sizes(ppo.Args(local_num_envs=4, num_steps=32, total_timesteps=12800), 1)
    args.print_every = print_every
    return ppo.Progress(args, 0)


def test_progress_line_names_the_slow_rank_only_when_the_imbalance_matters():
    p = progress()
    p.recent_returns.extend([1.0, 3.0])
    p.num_episodes = 2
    line = p.line(1, 128, 400, (1.30, 1))
    assert line.startswith("iter 1/100 | step 128 | ") and "SPS 400 | return 2.00" in line
    assert "ETA" in line and line.endswith("| imbalance 1.30: rank 1 is slowest")
    assert "imbalance" not in progress().line(1, 128, 400, (1.02, 1))


def test_progress_lines_come_every_print_every_seconds_and_at_the_first_and_last(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(ppo.time, "time", lambda: clock[0])
    p = progress(print_every=10.0)
    printed = []
    for iteration in range(1, 101):
        clock[0] += 0.5  # 2 iterations per second
        if p.line(iteration, iteration * 128, 256, (1.0, 0)):
            printed.append(iteration)
    assert printed == [1, 21, 41, 61, 81, 100]
    # at iteration 100 of 100 the ETA is zero; elapsed counts from the session's start
    assert p.line(100, 12800, 256, (1.0, 0)).split(" | ")[2] == "0:00:50 elapsed, ETA 0:00:00"


def test_collective_clock_sums_only_the_timed_blocks_and_restarts_after_each_read(monkeypatch):
    clock = [100.0]  # the host clock it reads on CPU, advanced by hand: no real waiting
    monkeypatch.setattr(ppo.time, "perf_counter", lambda: clock[0])
    timer = ppo.CollectiveClock(torch.device("cpu"))
    for inside in (0.25, 0.5):
        with timer:
            clock[0] += inside
        clock[0] += 8.0  # outside the blocks: not counted
    assert timer.read() == 0.75
    clock[0] += 1.0
    assert timer.read() == 0.0  # the read restarted the sum
    with timer:
        clock[0] += 2.0
    assert timer.read() == 2.0


def test_out_of_memory_errors_get_one_line_of_advice_and_others_none():
    cpu = torch.device("cpu")
    for exc in (
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        RuntimeError("DefaultCPUAllocator: can't allocate memory"),
    ):
        advice = ppo.oom_advice(exc, cpu)
        assert "out of memory" in advice and "GiB host RSS" in advice and "\n" not in advice
        for flag in ("--grad-accum", "--local-num-envs", "--num-steps"):
            assert flag in advice
    assert ppo.oom_advice(RuntimeError("shape mismatch"), cpu) is None


def test_an_out_of_memory_rank_stops_every_rank_with_the_advice_long_before_the_timeout(
    tmp_path,
):
    # Rank 1 runs out of memory in a convolution during its third iteration, while rank 0 waits
    # in a collective: both must stop with the advice, long before --pg-timeout.
    runner = tmp_path / "oom_runner.py"
    runner.write_text(
        "import os, runpy, torch\n"
        "calls = [0]\n"
        "forward = torch.nn.Conv2d._conv_forward\n"
        "def failing(self, *args):\n"
        "    calls[0] += 1\n"
        "    if os.environ['RANK'] == '1' and calls[0] > 600:\n"
        "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        "    return forward(self, *args)\n"
        "torch.nn.Conv2d._conv_forward = failing\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    cmd = [*torchrun(2, script=runner), *TINY, "--total-timesteps", "1280", "--eval-episodes", "0"]
    cmd += ["--pg-timeout", str(PG_TIMEOUT)]
    start = time.time()
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=PG_TIMEOUT)
    assert out.returncode != 0 and time.time() - start < PG_TIMEOUT / 2
    assert "error [rank 1]: out of memory (OutOfMemoryError: CUDA out of memory." in out.stderr
    assert "error [rank 0]: stopping, rank 1: out of memory" in out.stderr
    assert out.stderr.count("--grad-accum K") == 2
