"""benchmark/gpu_check.sh: its plan answers the most wanted questions first and fits its time
limit; its CPU dry run goes through every step the GPU run takes."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import torch
from conftest import ROOT

NUMBER = r"\d[\d,]*(\.\d+)?"
SECTIONS = (  # the run order: trainer rows before the ceilings
    "## 0. Wheels",
    "## 1. Preflight",
    "## 2. Trainer rows",
    "## 3. Ceiling: env stepping",
    "## 4. Ceiling: the trainer's update",
    "## 5. Results table",
)
ROWS = (  # the GPU plan's rows in run order; the dry run keeps their names and shrinks their sizes
    "1×8 sync",
    "2×4 native+bf16 compile gloo, one GPU",
    "1×8 native+bf16 compile",
    "1×8 native+bf16 compile+graphs",
)
PLATFORM = "- torch / CUDA / driver / GPU: "


def gpu_check():
    sys.path.insert(0, str(ROOT / "benchmark"))
    import gpu_check

    return gpu_check


def test_gpu_plan_runs_preflight_then_a_1x8_row_and_a_multi_rank_row_and_the_ceilings_last():
    gc = gpu_check()
    steps = [name for name, _ in gc.plan(dry=False)["steps"]]
    kinds = [gc.kind(name) for name in steps]
    assert kinds[:3] == ["wheels", "preflight", "row"]
    rows = [name for name in steps if gc.kind(name) == "row"]
    assert rows == list(ROWS)
    ranks, envs, _ = gc.ROWS[rows[0]]
    assert (ranks, envs) == (1, 8)
    # a multi-rank row among the first three: 2 ranks on the one GPU over gloo, native envs, bf16,
    # --compile, and the default --bucket-mb (the all-reduce overlapped with backward)
    multi = [name for name in rows[:3] if gc.ROWS[name][0] > 1]
    assert multi, rows
    ranks, _, flags = gc.ROWS[multi[0]]
    assert ranks == 2 and "--bucket-mb" not in flags
    for flag in ("--compile", "gloo", "native", "bf16"):
        assert flag in flags, flag
    # the CPU dry run compiles that row (the compile path every compile row shares), never graphs
    dry = gc.plan(dry=True)["rows"]
    assert "--compile" in dry[multi[0]][2]
    assert "--cuda-graphs" not in {f for _, _, flags in dry.values() for f in flags}
    # then the single-rank compile and CUDA-graph rows, and the ceilings last (and trimmed)
    assert {"--compile", "--cuda-graphs"} <= {f for n in rows for f in gc.ROWS[n][2]}
    assert kinds[len(rows) + 2 :] == ["env", "update"]
    assert len(gc.plan(dry=False)["env_grid"]) <= 4


def test_gpu_plan_caps_add_up_under_the_overall_time_limit():
    gc = gpu_check()
    caps = dict(gc.plan(dry=False)["steps"])
    assert all(cap > 0 for cap in caps.values()), caps
    assert sum(caps.values()) + gc.RESERVE_S <= gc.TOTAL_S <= 7 * 60, caps
    script = (ROOT / "benchmark/gpu_check.sh").read_text()
    # the shell's overall limit and its pip install's cap are the plan's
    assert f"TOTAL_S=${{GPU_CHECK_TOTAL_S:-{gc.TOTAL_S}}}" in script
    assert re.search(rf"^WHEELS_S={caps['wheels']}\s", script, re.M)
    assert 'timeout "$WHEELS_S" "$PY" -m pip install' in script
    # the dry run takes the same steps in the same order
    assert [name for name, _ in gc.plan(dry=True)["steps"]] == list(caps)


def test_every_step_gets_its_cap_even_when_each_step_before_uses_its_whole_budget(
    tmp_path, monkeypatch
):
    gc = gpu_check()
    now = [1000.0]
    monkeypatch.setattr(gc.time, "time", lambda: now[0])
    a = argparse.Namespace(out_dir=str(tmp_path), cpu_dry_run=False, deadline=None)
    check = gc.Check(a)  # its deadline: TOTAL_S - 5 s from now, as gpu_check.sh's
    shutil.rmtree(check.tmp)
    steps = check.plan["steps"]
    now[0] += steps[0][1]  # gpu_check.sh's wheels: all of their cap
    for step, cap in steps[1:]:
        seconds, skip = check.budget(step)
        assert skip is None and seconds >= cap, (step, seconds, cap)
        now[0] += seconds
    assert check.deadline - now[0] >= gc.TABLE_S  # the table still gets written
    # a step that finished early leaves its time to the next, not past the later steps' caps
    now[0] = 1000.0 + steps[0][1]
    first_row = steps[2][0]
    assert check.budget(first_row)[0] > dict(steps)[first_row]


def test_gpu_check_cpu_dry_run_writes_every_section_and_trainer_row_to_the_output_folder(tmp_path):
    out = tmp_path / "out"
    env = dict(
        os.environ,
        PYTHON=sys.executable,  # bash's python3 may not be this environment's
        GPU_CHECK_SITE=str(tmp_path / "site"),  # never the shared /tmp/site
        GPU_CHECK_TOTAL_S="280",  # the script's own limit, inside this test's timeout
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmark/gpu_check.sh"), str(out), "--cpu-dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=330,
    )
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr + summary[-3000:]
    for i, section in enumerate(SECTIONS):
        assert section in summary, section
        if i:  # in order
            assert summary.index(SECTIONS[i - 1]) < summary.index(section)
    # the torch (and CUDA, driver, GPU) every figure ran on, at the top and over the table
    torch_version = re.escape(torch.__version__)
    top = re.search(rf"^{re.escape(PLATFORM)}torch {torch_version} .*GPU none", summary, re.M)
    assert top and top.start() < summary.index(SECTIONS[0]), summary[:1500]
    assert summary.count(PLATFORM) == 1
    for step, (start, end) in {"preflight": (1, 2), "env": (3, 4), "update": (4, 5)}.items():
        body = summary[summary.index(SECTIONS[start]) : summary.index(SECTIONS[end])]
        assert re.search(r"^- ok \(\d+ s; log: `", body, re.M), (step, body)
    assert "- import ppo_atari_multigpu.py: ok" in summary
    env_rows = re.findall(rf"^\| 8 \| 1 \| {NUMBER} \| {NUMBER} \|$", summary, re.M)
    assert len(env_rows) == 1, summary
    for precision in ("fp32", "bf16"):
        assert re.search(rf"^\| 32 \| {precision} \| cpu \| {NUMBER} \| \d+ \|$", summary, re.M)
    table = summary[summary.index(SECTIONS[5]) :]
    assert re.search(rf"^Ran on torch {torch_version} ", table, re.M), table[:500]
    for row in ROWS:  # whole-run SPS and SPS after warm-up, both numbers
        cells = rf"^\| {re.escape(row)} \| \d+×2×16 \| cpu \| {NUMBER} \| {NUMBER} \|"
        assert re.search(cells, table, re.M), (row, table)
    assert "| 2×2×16 |" in table  # the multi-rank row: 2 ranks in the dry run too
    assert "every step ok" in table
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results["rows"]] == list(ROWS)
    assert all(r["sps_run"] > 0 and r["sps_after_warmup"] > 0 for r in results["rows"])
    assert results["platform"]["torch"] == torch.__version__
    # what a device call brings back from its output folder: at most 8 files
    assert sorted(p.name for p in out.iterdir()) == sorted(
        "summary.md results.json preflight.log env-ceiling.log update-ceiling.log "
        "trainer-rows.log".split()
    )
