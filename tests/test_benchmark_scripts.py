"""Scripts in benchmark/: the reproduction dry run, and the SLURM launch and requeue."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT


def test_reproduction_dry_run_prints_all_18_runs_without_starting_any(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "benchmark/ppo_atari_multigpu.sh"), "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 18 and not (tmp_path / "runs").exists()
    for game in ("PongNoFrameskip-v4", "BeamRiderNoFrameskip-v4", "BreakoutNoFrameskip-v4"):
        for seed in (1, 2, 3):
            runs = [line for line in lines if f"--env-id {game} --seed {seed} " in line]
            assert len(runs) == 2 and all("--total-timesteps 10000000" in run for run in runs)
            assert any(
                run.startswith("torchrun --standalone --nproc_per_node=2")
                and "--local-num-envs 4" in run
                for run in runs
            )
            assert any(run.startswith("python ") and "--local-num-envs 8" in run for run in runs)


def test_slurm_script_builds_one_torchrun_per_node_with_c10d_and_resume_auto(tmp_path):
    env = dict(
        os.environ, HEAD_NODE="n01", SLURM_NNODES="4", SLURM_GPUS_ON_NODE="8", SLURM_JOB_ID="77"
    )
    out = subprocess.run(
        ["bash", str(ROOT / "benchmark/slurm.sbatch"), "--dry-run", "--num-envs", "64"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    # the port follows the job id (20000 + 77); torchrun waits 100 s of the 120 s warning window
    assert (
        out.stdout.split()
        == (
            "srun --kill-on-bad-exit=0 torchrun --nnodes=4 --nproc_per_node=8 --rdzv-id=77 "
            "--rdzv-backend=c10d --rdzv-endpoint=n01:20077 --max-restarts=3 --shutdown-timeout=100 "
            "ppo_atari_multigpu.py --resume auto --num-envs 64"
        ).split()
    )


# Stand-ins for SLURM's tools, as they behave on a real cluster (benchmark/slurm_check.sh proves
# the real ones): srun starts the step (after STEP_DELAY s) and answers a TERM of its own by
# killing it; the step is the trainer under torchrun: on TERM it writes the marker the script
# gave it and exits 1, as a signalled torchrun does; squeue lists the step once it runs; scancel
# signals the step's processes; scontrol looks up the head node (after a file `go` appears, with
# HOLD_LOOKUP) and records a requeue. Everything they see goes to slurm.log, in order.
FAKE_SLURM = {
    "srun": """env > srun.env
trap 'echo srun-got-term >> slurm.log; kill -KILL $step; exit 143' TERM
touch srun-invoked
sleep "${STEP_DELAY:-0}"
step &
step=$!
echo $step > step.pid
wait $step
code=$?
while kill -0 $step 2>/dev/null; do wait $step; code=$?; done
exit $code
""",
    "step": """on_term() {
  echo step-got-term >> slurm.log
  echo saved > "$PPO_PREEMPTED_MARKER"
  exit 1
}
trap on_term TERM
echo step-started >> slurm.log
if [ -n "${STEP_FAILS:-}" ]; then exit 1; fi
while true; do sleep 0.1; done
""",
    "squeue": """echo 77.batch
if [ -s step.pid ]; then echo 77.0; fi
""",
    "scancel": """echo scancel "$@" >> slurm.log
if [ -s step.pid ]; then kill -TERM "$(cat step.pid)"; fi
""",
    "scontrol": """if [ "$1" = show ]; then
  touch looking-up
  if [ -n "${HOLD_LOOKUP:-}" ]; then
    for _ in $(seq 200); do [ -e go ] && break; sleep 0.1; done
  fi
  echo n01
else
  echo scontrol "$@" >> slurm.log
fi
""",
}


def start_slurm_script(tmp_path, **env_vars):
    """benchmark/slurm.sbatch as job 77 (cpus-per-task 6) among the stand-ins, in tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in FAKE_SLURM.items():
        (bin_dir / tool).write_text("#!/bin/bash\n" + body)
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "PPO_"))}
    env.pop("HEAD_NODE", None)
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77")
    env.update(SLURM_CPUS_PER_TASK="6", **env_vars)
    return subprocess.Popen(
        ["bash", str(ROOT / "benchmark/slurm.sbatch"), "--num-envs", "8"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(path, what):
    deadline = time.time() + 20
    while not path.exists():
        assert time.time() < deadline, what
        time.sleep(0.05)


def slurm_log(tmp_path):
    return (tmp_path / "slurm.log").read_text().splitlines()


def test_slurm_script_passes_the_warning_to_the_step_not_srun_and_requeues_on_the_marker(
    tmp_path,
):
    # the warning comes as srun starts, before its step exists: it must reach the step all the same
    proc = start_slurm_script(tmp_path, STEP_DELAY="1")
    wait_for(tmp_path / "srun-invoked", "srun never started")
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, stdout
    assert slurm_log(tmp_path) == [
        "step-started",
        "scancel --signal=TERM 77",
        "step-got-term",
        "scontrol requeue 77",
    ]  # srun never got a TERM: it would have killed the step
    assert "the trainer saved and stopped on a signal (exit 1): requeueing job 77" in stdout
    assert not (tmp_path / "slurm-77.preempted").exists()  # read and removed


def test_slurm_script_requeues_a_preempted_step_it_was_not_signalled_for_and_gives_srun_its_cpus(
    tmp_path,
):
    # preemption: SLURM signals the job's steps, never this script; only the marker tells it
    proc = start_slurm_script(tmp_path)
    wait_for(tmp_path / "step.pid", "the step never started")
    os.kill(int((tmp_path / "step.pid").read_text()), signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, stdout
    assert slurm_log(tmp_path) == ["step-started", "step-got-term", "scontrol requeue 77"]
    srun_env = dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines())
    assert srun_env["SRUN_CPUS_PER_TASK"] == "6"  # srun would give each task one CPU
    assert srun_env["PPO_PREEMPTED_MARKER"] == str(tmp_path / "slurm-77.preempted")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in srun_env  # fixed node count: not needed
    # the job's first launch: nothing to resume yet; its requeue must find a checkpoint
    assert "PPO_RESUME_EXPECTED" not in srun_env and (tmp_path / "slurm-77.launched").exists()


def test_slurm_script_passes_on_a_failure_without_marker_or_signal_and_does_not_requeue(tmp_path):
    (tmp_path / "slurm-77.preempted").write_text("left by an earlier start")  # stale: removed
    (tmp_path / "slurm-77.launched").touch()  # a requeued start: an earlier one launched
    proc = start_slurm_script(tmp_path, STEP_FAILS="1")
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, stdout
    assert slurm_log(tmp_path) == ["step-started"] and "requeue" not in stdout
    assert "PPO_RESUME_EXPECTED=1" in (tmp_path / "srun.env").read_text().splitlines()
    assert not (tmp_path / "slurm-77.launched").exists()  # the job ended: nothing left


def test_slurm_script_requeues_at_once_on_a_warning_that_comes_before_the_launch(tmp_path):
    # TERM while the script still looks up the head node (scontrol, held until the test lets it
    # go): the signal is not lost, does not kill the script, and no srun starts
    proc = start_slurm_script(tmp_path, HOLD_LOOKUP="1")
    wait_for(tmp_path / "looking-up", "the script never looked up the head node")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # bash runs the trap once scontrol returns
    (tmp_path / "go").touch()
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, stdout
    assert "signalled before the launch: requeueing job 77" in stdout
    assert slurm_log(tmp_path) == ["scontrol requeue 77"]
    assert not (tmp_path / "srun-invoked").exists()
    assert not (tmp_path / "slurm-77.launched").exists()  # its requeue starts afresh


# ONEDNN_VERBOSE=1 output as oneDNN 3.x prints it (torch 2.13), with what must not count: info
# lines, a primitive's creation (its last field is the creation time), a graph line, other output
ONEDNN_LOG = """\
onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71049cd69a3df32adcccb623b12cd7baa22)
onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with Intel DL Boost and bfloat16 support
onednn_verbose,v1,primitive,info,template:operation,engine,primitive,implementation,prop_kind,\
memory_descriptors,attributes,auxiliary,problem_desc,exec_time
onednn_verbose,v1,primitive,create:cache_miss,cpu,convolution,brg_conv_fwd:avx512_core,\
forward_training,src:f32::blocked:acdb::f0 wei:f32:ap:blocked:Acdb16a::f0,attr-scratchpad:user,\
alg:convolution_direct,mb2_ic4oc8_ih9oh7kh3sh1dh0ph0_iw9ow7kw3sw1dw0pw0,7.25
onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:f32::blocked:acdb::f0 \
dst:f32:p:blocked:Acdb16a::f0,attr-scratchpad:user,,8x4x3x3,0.00219727
onednn_verbose,v1,primitive,exec,cpu,convolution,brg_conv_fwd:avx512_core,forward_training,\
src:f32::blocked:acdb::f0 wei:f32:ap:blocked:Acdb16a::f0,attr-scratchpad:user,\
alg:convolution_direct,mb2_ic4oc8_ih9oh7kh3sh1dh0ph0_iw9ow7kw3sw1dw0pw0,0.0158691
onednn_verbose,v1,graph,exec,cpu,100002,sdp,,,,,,dnnl_backend,3.5
iter 1/2 | step 64 | exec 1.0
onednn_verbose,v1,primitive,exec,cpu,convolution,jit:avx512_core,backward_weights,\
src:f32::blocked:acdb::f0 wei:f32:ap:blocked:Acdb16a::f0,attr-scratchpad:user,\
alg:convolution_direct,mb2_ic4oc8_ih9oh7kh3sh1dh0ph0_iw9ow7kw3sw1dw0pw0,0.00805664
"""


def update_ceiling():
    sys.path.insert(0, str(ROOT / "benchmark"))
    import update_ceiling

    return update_ceiling


def test_onednn_time_is_the_sum_of_the_primitives_exec_lines_and_none_when_none_ran():
    uc = update_ceiling()
    assert uc.onednn_exec_ms(ONEDNN_LOG.splitlines(keepends=True)) == pytest.approx(
        0.00219727 + 0.0158691 + 0.00805664
    )
    # an AVX2-only CPU: torch keeps bf16 convolutions off oneDNN, which prints only its info
    info_only = [line for line in ONEDNN_LOG.splitlines() if ",exec," not in line]
    assert uc.onednn_exec_ms(info_only) is None and uc.onednn_exec_ms([]) is None


def test_update_ceiling_tables_have_every_layer_and_part_and_the_gemm_shapes_add_up(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmark/update_ceiling.py"),
            *("--minibatch", "2", "--rollout-batch", "3", "--repeats", "1"),
            *("--peak-size", "256"),  # bf16 on AVX2 (no bf16 instructions): 2048 takes minutes
            *("--out", str(tmp_path / "t.md")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in (tmp_path / "t.md").read_text().splitlines() if line.startswith("| ")]
    for dtype in ("fp32", "bf16"):
        for layer in ("conv1", "conv2", "conv3", "fc", "**all layers**", "256² matmul (peak)"):
            assert any(row.startswith(f"| {dtype} | {layer} |") for row in rows), (dtype, layer)
        for layer in ("conv1", "conv2", "conv3", "fc"):  # (c): im2col + matmul, in ms
            row = next(r for r in rows if r.startswith(f"| {dtype} | {layer} |"))
            assert float(row.strip("| ").split(" | ")[7]) > 0, row
        # the rollout row: forward GFLOP of 3 samples = 3 x (conv1 + conv2 + conv3 + fc) MACs x 2
        macs = 400 * 256 * 32 + 81 * 512 * 64 + 49 * 576 * 64 + 3136 * 512
        row = f"| {dtype} | rollout forward, batch 3 (forward ms) | {3 * 2 * macs / 1e9:.3f} |"
        assert any(r.startswith(row) for r in rows), (dtype, row)
    # the second table: the trainer's step split into its parts, oneDNN's times read from its log
    uc = update_ceiling()
    cells = [r.strip("| ").split(" | ") for r in rows]
    for dtype in ("fp32", "bf16"):
        parts = {c[1]: c[2].strip("*") for c in cells if len(c) == 3 and c[0] == dtype}
        onednn = parts.pop(uc.ONEDNN_PART)
        # a time where oneDNN ran (what ran there is the CPU's and torch's choice), else the marker
        assert onednn == uc.NOT_USED or float(onednn) > 0, onednn
        ms = {k: float(v) for k, v in parts.items()}
        step = [
            v for k, v in ms.items() if k.startswith(("minibatch_gradient", "clip", "Adam, fore"))
        ]
        assert len(step) == 3 and len(ms) == 6, ms
        assert abs(ms["**the trainer's step: gradient + clip + Adam**"] - sum(step)) < 0.02
    # the matmul shapes carry the layers' arithmetic: 2 x (M K N) per product, as counted by hand
    shapes = uc.gemm_shapes(1)
    assert shapes["conv1"] == [(400, 256, 32), (32, 400, 256)]  # 20x20 outputs, 4x8x8 patches
    assert shapes["fc"][0] == (1, 3136, 512) and len(shapes["conv2"]) == 3


def slow_link():
    sys.path.insert(0, str(ROOT / "benchmark"))
    import slow_link

    return slow_link


def test_slow_link_says_in_one_line_what_the_machine_lacks_and_exits_non_zero(tmp_path):
    sl = slow_link()
    assert sl.missing(0, lambda tool: "/usr/sbin/" + tool) is None
    assert "needs root" in sl.missing(1000, lambda tool: "/usr/sbin/" + tool)
    assert sl.missing(0, lambda tool: None if tool == "tc" else tool).endswith("not found: tc")
    # as a user without root would run it (here: nothing on PATH, so no ip either)
    env = dict(os.environ, PATH=str(tmp_path))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmark/slow_link.py"), "--repeats", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("slow_link.py needs") and not out.stdout


def test_slow_link_table_has_every_row_with_its_ratio_to_the_unshaped_default(tmp_path):
    import argparse
    import datetime

    import numpy as np

    sl = slow_link()
    parts = {k: (np.array([1.0, 1.0]), None) for k in ("env", "inference", "update")}
    results = {
        (link, mode): [
            {"sps": sps, "parts": {**parts, "allreduce": (np.array([a_r, a_r]), None)}}
            for sps in (base, base * 1.1)
        ]
        for link, mode, base, a_r in (
            ("unshaped", "overlap", 400.0, 0.1),
            ("unshaped", "one", 380.0, 0.2),
            ("1gbit", "overlap", 300.0, 1.0),
        )
    }
    results["1gbit", "one"] = [{"error": "boom"}]
    a = argparse.Namespace(
        host="h", repeats=2, iterations=10, env_id="E", links=["unshaped", "1gbit"],
        modes=["overlap", "one"],
    )  # fmt: skip
    md = sl.report(a, results, datetime.datetime.now().astimezone(), (0, 1), 8_000_000)
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in md.splitlines()}
    overlap, one = sl.MODES["overlap"][0], sl.MODES["one"][0]
    assert "| 0.95 (0.95–0.95) |" in rows["unshaped", one]  # 380 / 400, per repeat alike
    assert "| 0.75 (0.75–0.75) |" in rows["1gbit", overlap]
    assert rows["1gbit", overlap].endswith("| 1.000 | 0.25 |")  # all-reduce s, its share of 4 s
    assert "failed: boom" in rows["1gbit", one]
    assert "1gbit 1.02 s of transfer per iteration" in md  # 16 x 8 MB at 1 Gbit/s


def test_uneven_splits_become_trainer_flags_and_the_table_compares_each_with_equal():
    import argparse
    import datetime

    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmark"))
    import uneven

    assert uneven.split_flags("equal") == [] and uneven.split_flags("auto") == ["--balance-envs"]
    assert uneven.split_flags("5,3") == ["--rank-envs", "5", "3"]
    for bad in ("5,2", "8", "a,b", "0,8"):
        with pytest.raises(argparse.ArgumentTypeError):
            uneven.split_flags(bad)

    def run(sps, end):
        busy = [np.array([2.0, 2.0]), np.array([4.0, 4.0])]
        return {"sps": sps, "busy": busy, "imbalance": np.array([1.3, 1.3]),
                "splits": np.array([[4, 4], end]), "moves": []}  # fmt: skip

    results = {
        ("hog", "equal"): [run(200.0, [4, 4]), run(220.0, [4, 4])],
        ("hog", "auto"): [run(260.0, [6, 2]), run(286.0, [6, 2])],
        ("hog", "6,2"): [{"error": "boom"}],
    }
    results["hog", "auto"][0]["moves"] = ["envs 4 4 -> 6 2, imbalance 1.35 -> 1.18 (predicted)"]
    a = argparse.Namespace(host="h", repeats=2, iterations=30, env_id="E", loads=["hog"],
                           splits=["equal", "6,2", "auto"])  # fmt: skip
    md = uneven.report(a, results, datetime.datetime.now().astimezone(), (0, 1))
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in md.splitlines()}
    assert "| 1.30 (1.30–1.30) | 6 + 2 | 2.00 / 4.00 | 1.30 |" in rows["hog", "auto"]
    assert "failed: boom" in rows["hog", "6,2"]
    assert "envs 4 4 -> 6 2, imbalance 1.35 -> 1.18 (predicted)" in md


def test_chaos_soak_kills_a_rank_sees_the_run_resume_and_checks_it_from_its_files(tmp_path):
    # the shortest soak: one SIGKILL of a rank as soon as the run trains (--gap 0 0), then the
    # final SIGTERM and the checks; --warmup-sps 1 skips the warm-up (goodput is not judged here)
    out = tmp_path / "chaos.md"
    cmd = [sys.executable, str(ROOT / "benchmark/chaos.py"), "--minutes", "0", "--faults", "1"]
    cmd += ["--seed", "1", "--warmup-sps", "1", "--kinds", "kill_rank", "--gap", "0", "0"]
    cmd += ["--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.terminate()  # chaos.py kills its runs on a TERM
        stdout, _ = proc.communicate()
    report = out.read_text()
    assert proc.returncode == 0, stdout + report
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| ")]
    fault = next(row for row in rows if row[1] == "kill_rank")
    assert "died without a word" in fault[3] and fault[4] == "yes", fault  # named, recovered
    checks = {row[0][2:]: row[1] for row in rows if row[1] in ("pass", "**FAIL**")}
    assert len(checks) == 7 and set(checks.values()) == {"pass"}, checks
    logged = next(row[2] for row in rows if row[0] == "| charts/SPS logged once per iteration")
    assert int(logged.split(" steps to ")[0]) >= 2, logged  # trained past the killed iteration
