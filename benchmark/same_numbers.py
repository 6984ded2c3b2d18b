"""Same numbers as an earlier trainer: a short run of this checkout's trainer and of the one at
git revision REV, same flags (default: 2 ranks x 2 envs on CPU, 3 iterations), and their final
models compared parameter by parameter. A change that claims to leave learning unchanged must
print `bit-identical: True`.
    python benchmark/same_numbers.py REV [--nproc 2] [-- extra trainer flags]
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FLAGS = "--no-cuda --local-num-envs 2 --num-steps 32 --update-epochs 2 --num-minibatches 2 "
FLAGS += "--total-timesteps 384 --eval-episodes 0 --threads 1 --run-name same"


def final_model(script, nproc, flags, workdir):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launcher, f"--nproc_per_node={nproc}", str(script), *flags] if nproc > 1 else [
        sys.executable, str(script), *flags]  # fmt: skip
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"{script} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return torch.load(Path(workdir) / "runs/same/ppo_atari_multigpu.model", weights_only=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="more trainer flags (after --)")
    a = parser.parse_args()
    flags = FLAGS.split() + a.extra
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old" / "ppo_atari_multigpu.py"
        old.parent.mkdir()
        old.write_text(
            subprocess.check_output(
                ["git", "-C", str(ROOT), "show", f"{a.rev}:ppo_atari_multigpu.py"], text=True
            )
        )
        models = []
        for name, script in (("old", old), ("new", ROOT / "ppo_atari_multigpu.py")):
            (Path(tmp) / f"run-{name}").mkdir()
            models.append(final_model(script, a.nproc, flags, Path(tmp) / f"run-{name}"))
    old_model, new_model = models
    same = old_model.keys() == new_model.keys() and all(
        torch.equal(old_model[k], new_model[k]) for k in old_model
    )
    worst = max((old_model[k] - new_model[k]).abs().max().item() for k in old_model
                if k in new_model and old_model[k].shape == new_model[k].shape)  # fmt: skip
    print(f"{a.rev} vs this checkout, {a.nproc} rank(s), flags {' '.join(flags)}")
    print(f"bit-identical: {same} (largest difference {worst:g})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
