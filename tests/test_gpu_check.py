"""benchmark/gpu_check.sh: its CPU dry run goes through every step the GPU run takes."""

import json
import os
import re
import subprocess
import sys

from conftest import ROOT

NUMBER = r"\d[\d,]*(\.\d+)?"
SECTIONS = (
    "## 0. Wheels",
    "## 1. Preflight",
    "## 2. Ceiling: env stepping",
    "## 3. Ceiling: the trainer's update",
    "## 4. Trainer rows",
    "## 5. Results table",
)
ROWS = (  # the GPU plan's rows; the dry run keeps their names and shrinks their sizes
    "1×8 sync",
    "1×8 native+bf16",
    "1×8 native+bf16 compile",
    "1×8 native+bf16 compile+graphs",
    "1×64 native+bf16",
    "1×64 native+bf16 compile",
    "1×64 native+bf16 compile+graphs",
    "1×64 native+bf16 async",
    "4×16 native+bf16 gloo, one GPU",
)


def test_gpu_check_cpu_dry_run_writes_every_section_and_trainer_row_to_the_output_folder(tmp_path):
    out = tmp_path / "out"
    env = dict(
        os.environ,
        PYTHON=sys.executable,  # bash's python3 may not be this environment's
        GPU_CHECK_SITE=str(tmp_path / "site"),  # never the shared /tmp/site
        GPU_CHECK_TOTAL_S="280",  # the script's own limit, inside this test's timeout
        # the compile rows' kernels in a cache of their own, as on a fresh machine (never ones
        # an earlier run built for another ISA: see test_fast_path)
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
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
    for step, (start, end) in {"preflight": (1, 2), "env": (2, 3), "update": (3, 4)}.items():
        body = summary[summary.index(SECTIONS[start]) : summary.index(SECTIONS[end])]
        assert re.search(r"^- ok \(\d+ s; log: `", body, re.M), (step, body)
    assert "- import ppo_atari_multigpu.py: ok" in summary
    env_rows = re.findall(rf"^\| 8 \| 1 \| {NUMBER} \| {NUMBER} \|$", summary, re.M)
    assert len(env_rows) == 1, summary
    for precision in ("fp32", "bf16"):
        assert re.search(rf"^\| 32 \| {precision} \| cpu \| {NUMBER} \| \d+ \|$", summary, re.M)
    table = summary[summary.index(SECTIONS[5]) :]
    for row in ROWS:  # whole-run SPS and SPS after warm-up, both numbers
        cells = rf"^\| {re.escape(row)} \| \d+×2×16 \| cpu \| {NUMBER} \| {NUMBER} \|"
        assert re.search(cells, table, re.M), (row, table)
    assert "every step ok" in table
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results["rows"]] == list(ROWS)
    assert all(r["sps_run"] > 0 and r["sps_after_warmup"] > 0 for r in results["rows"])
    # what a device call brings back from its output folder: at most 8 files
    assert sorted(p.name for p in out.iterdir()) == sorted(
        "summary.md results.json preflight.log env-ceiling.log update-ceiling.log "
        "trainer-rows.log".split()
    )
