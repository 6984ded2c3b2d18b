"""The reproduction script's dry run lists every published run and starts none."""

import subprocess

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
