"""benchmark/throughput.py --reference: the reference's launch command, one run of a fake
reference (fixed event wall times, so no dependence on machine speed), and the ratio column."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "benchmark_throughput", Path(__file__).resolve().parents[1] / "benchmark" / "throughput.py"
)
throughput = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(throughput)

# A CleanRL-shaped stand-in: tyro-style --help; a run writes charts/SPS events every 2.0 s of
# wall time into runs/<env>__<exp name>__1__<time>/ of its working directory.
FAKE = """
import sys, time
if "--help" in sys.argv:
    print("--env-id STR  --local-num-envs INT  --num-steps INT  --total-timesteps INT")
    print("--exp-name STR  --cuda, --no-cuda")
    sys.exit(0)
assert "--no-cuda" in sys.argv, sys.argv
argv = [x for x in sys.argv[1:] if x != "--no-cuda"]
opts = dict(zip(argv[::2], argv[1::2]))
from torch.utils.tensorboard import SummaryWriter
writer = SummaryWriter(f"runs/{opts['--env-id']}__{opts['--exp-name']}__1__{int(time.time())}")
batch = int(opts["--local-num-envs"]) * int(opts["--num-steps"])
for i in range(int(opts["--total-timesteps"]) // batch):
    writer.add_scalar("charts/SPS", 1, (i + 1) * batch, walltime=1_700_000_000.0 + 2.0 * i)
writer.close()
"""


def args(**kw):
    base = dict(env_id="BreakoutNoFrameskip-v4", iterations=6, cuda=False, timeout=120)
    return argparse.Namespace(**{**base, **kw})


def test_reference_command_is_torchrun_of_its_interpreter_with_cleanrl_flags():
    a = args(reference="/x/ref.py", reference_python="/venv/bin/python", iterations=20)
    cmd = throughput.reference_cmd(a, 2, 4, "bench-reference-2x4-0", ["--no-cuda"])
    assert (
        cmd
        == (
            "/venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 /x/ref.py "
            "--env-id BreakoutNoFrameskip-v4 --local-num-envs 4 --num-steps 128 "
            "--total-timesteps 20480 --no-cuda --exp-name bench-reference-2x4-0"
        ).split()
    )
    # one rank: plain python, like ours; with --cuda no CUDA flag at all
    cmd = throughput.reference_cmd(
        args(reference="r.py", reference_python="py", cuda=True), 1, 8, "n", ["--cuda", "False"]
    )
    assert cmd[:2] == ["py", "r.py"] and "--cuda" not in cmd and "--no-cuda" not in cmd


def test_one_reference_per_layout_and_no_paths_in_the_recorded_command():
    configs = [
        ("2x4 default", 2, 4, []),
        ("2x4 bf16", 2, 4, ["--amp", "bf16"]),
        ("1x8 x", 1, 8, []),
    ]
    assert throughput.reference_configs(configs) == [
        ("reference 2x4", 2, 4, []),
        ("reference 1x8", 1, 8, []),
    ]
    argv = ["t.py", "--reference", "/a/ref.py", "--reference-python=/b/py", "--repeats", "2"]
    assert throughput.shown_argv(argv) == [
        "t.py",
        "--reference",
        "SCRIPT",
        "--reference-python=PY",
        "--repeats",
        "2",
    ]


def test_fake_reference_is_probed_and_measured_from_its_event_wall_times(tmp_path):
    script = tmp_path / "fake_ref.py"
    script.write_text(FAKE)
    a = args(reference=str(script), reference_python=sys.executable)
    probe = throughput.probe_reference(a, tmp_path)
    assert probe["cuda_flags"] == ["--no-cuda"] and len(probe["sha256"]) == 12
    assert set(probe["versions"]) >= {"torch", "gymnasium", "ale-py", "numpy"}
    job = ("reference 1x8", 1, 8, [])
    res = throughput.run_reference(job, 0, a, tmp_path, probe["cuda_flags"])
    # 6 iterations, 2 warm-up ones skipped: 4 x 1024 steps in 4 x 2.0 s
    assert res == {"sps": pytest.approx(512.0), "parts": {}}
    assert not (tmp_path / "bench-reference-1x8-0").exists()  # its scratch folder is gone


def test_ratio_column_uses_the_reference_of_this_run_and_pairs_repeats():
    ours = [{"sps": 600.0, "parts": {}}, {"sps": 700.0, "parts": {}}, {"error": "boom"}]
    ref = [{"sps": 300.0, "parts": {}}, {"sps": 400.0, "parts": {}}, {"sps": 350.0, "parts": {}}]
    # medians 650 / 350; per repeat 2.00 and 1.75 (the failed third repeat has no pair)
    row = throughput.trainer_row("2x4 default", 2, 4, ours, None, ref, measured_ref=True)
    assert "| 1.86 (1.75–2.00) |" in row and "1/3 FAILED: boom" in row
    ref_row = throughput.trainer_row("reference 2x4", 2, 4, ref, None, ref, measured_ref=True)
    assert "| 350 |" in ref_row and "| 1.00 (1.00–1.00) |" in ref_row
    assert "no per-part timings" in ref_row
    # a layout whose reference failed every time: no ratio; without --reference: the fixed one
    row = throughput.trainer_row("2x4 default", 2, 4, ours, None, [{"error": "x"}], True)
    assert "no reference SPS" in row
    row = throughput.trainer_row("2x4 default", 2, 4, ours, None)
    assert f"| {650 / throughput.REF_SPS:.2f} |" in row
