"""Scripts in benchmark/: the reproduction dry run, and the SLURM launch and requeue."""

import os
import signal
import subprocess
import sys
import time

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
    assert (
        out.stdout.split()
        == (
            "srun --kill-on-bad-exit=0 torchrun --nnodes=4 --nproc_per_node=8 --rdzv-id=77 "
            "--rdzv-backend=c10d --rdzv-endpoint=n01:29400 --max-restarts=3 ppo_atari_multigpu.py "
            "--resume auto --num-envs 64"
        ).split()
    )


def test_slurm_script_passes_the_warning_signal_on_and_requeues(tmp_path):
    # stand-ins for srun (a trainer that exits PREEMPTED on TERM) and scontrol (records its args)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/bin/bash\ntrap 'echo got-term >> trainer.log; exit 75' TERM\n"
        "echo started >> trainer.log\nwhile true; do sleep 0.1; done\n"
    )
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$@" >> scontrol.log\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = dict(
        os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HEAD_NODE="n01", SLURM_JOB_ID="77"
    )
    proc = subprocess.Popen(
        ["bash", str(ROOT / "benchmark/slurm.sbatch")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 20
    while not (tmp_path / "trainer.log").exists():
        assert time.time() < deadline, "the launch command never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, stdout
    assert (tmp_path / "trainer.log").read_text().split() == ["started", "got-term"]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77"]


def test_update_ceiling_tables_have_every_layer_and_part_and_the_gemm_shapes_add_up(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmark/update_ceiling.py"),
            *("--minibatch", "2", "--rollout-batch", "3", "--repeats", "1"),
            *("--out", str(tmp_path / "t.md")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in (tmp_path / "t.md").read_text().splitlines() if line.startswith("| ")]
    for dtype in ("fp32", "bf16"):
        for layer in ("conv1", "conv2", "conv3", "fc", "**all layers**", "2048² matmul (peak)"):
            assert any(row.startswith(f"| {dtype} | {layer} |") for row in rows), (dtype, layer)
        for layer in ("conv1", "conv2", "conv3", "fc"):  # (c): im2col + matmul, in ms
            row = next(r for r in rows if r.startswith(f"| {dtype} | {layer} |"))
            assert float(row.strip("| ").split(" | ")[7]) > 0, row
        # the rollout row: forward GFLOP of 3 samples = 3 x (conv1 + conv2 + conv3 + fc) MACs x 2
        macs = 400 * 256 * 32 + 81 * 512 * 64 + 49 * 576 * 64 + 3136 * 512
        row = f"| {dtype} | rollout forward, batch 3 (forward ms) | {3 * 2 * macs / 1e9:.3f} |"
        assert any(r.startswith(row) for r in rows), (dtype, row)
    # the second table: the trainer's step split into its parts, oneDNN's times read from its log
    cells = [r.strip("| ").split(" | ") for r in rows]
    for dtype in ("fp32", "bf16"):
        ms = {c[1]: float(c[2].strip("*")) for c in cells if len(c) == 3 and c[0] == dtype}
        step = [
            v for k, v in ms.items() if k.startswith(("minibatch_gradient", "clip", "Adam, fore"))
        ]
        assert len(step) == 3 and len(ms) == 7, ms
        assert abs(ms["**the trainer's step: gradient + clip + Adam**"] - sum(step)) < 0.02
        assert ms["oneDNN primitives inside it (convolutions; in bf16 also fc)"] > 0  # parsed
    # the matmul shapes carry the layers' arithmetic: 2 x (M K N) per product, as counted by hand
    sys.path.insert(0, str(ROOT / "benchmark"))
    from update_ceiling import gemm_shapes

    shapes = gemm_shapes(1)
    assert shapes["conv1"] == [(400, 256, 32), (32, 400, 256)]  # 20x20 outputs, 4x8x8 patches
    assert shapes["fc"][0] == (1, 3136, 512) and len(shapes["conv2"]) == 3
