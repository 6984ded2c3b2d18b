"""The GPU check of ppo_atari_multigpu.py: one bounded run on a lent GPU machine. Start it through
benchmark/gpu_check.sh, which installs carried wheels first and holds the overall time limit:
    bash benchmark/gpu_check.sh OUT_DIR [--cpu-dry-run]
Steps, most wanted first (each in its own bounded process; each appends its section to
OUT_DIR/summary.md and writes its own log as soon as it ends, so a run cut short keeps what it
measured):
  1 preflight: versions (torch, CUDA, driver, GPU: also named at the top of the summary), CUDA,
    nvidia-smi, lscpu, the imports the trainer needs
  2 trainer rows: short real runs of the trainer (1x8 default; 2 ranks on the one GPU with gloo,
    native envs, bf16, --compile and the overlapped all-reduce; 1x8 --compile, then with
    --cuda-graphs); SPS from its own output and TensorBoard events
  3 ceiling: ale-py's AtariVectorEnv stepping with random actions, 4 envs x threads cells
  4 ceiling: the trainer's own update (minibatch_gradient + clip + Adam), fp32 and bf16
  5 the table of every row, with the goals stated for reference
Each step has a cap (GPU_STEPS); the caps add up under the overall limit, so a GPU run reaches
every step. --cpu-dry-run runs the same steps on CPU with tiny sizes (2-3 minutes on 2 shared
cores), so the script cannot rot.
"""

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the repo, from this import or the trainer's
sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import TRAINER, error_line, load_trainer, process_tree  # noqa: E402

GOALS = {8: 10_000, 64: 25_000}  # SPS goals by total envs (64: "64 or more"); reference only
LOG = {  # one log per step; with summary.md and results.json: 6 files, fewer than the 8 a
    # device call brings back
    "preflight": "preflight.log",  # gpu_check.sh writes the wheel install's output here first
    "env": "env-ceiling.log",
    "update": "update-ceiling.log",
    "trainer": "trainer-rows.log",
}
TOTAL_S = 420  # gpu_check.sh's overall limit (default and most): 7 minutes of a 15-minute lease
TABLE_S = 5  # kept for the final table; gpu_check.sh's deadline is TOTAL_S - 5 s
RESERVE_S = TABLE_S + 5  # what the steps' caps leave of TOTAL_S, at least
NATIVE_BF16 = ["--env-backend", "native", "--amp", "bf16"]
COMPILE, GRAPHS = ["--compile"], ["--compile", "--cuda-graphs"]
# Trainer rows: name -> (ranks, envs per rank, flags). Ranks > 1 share GPU 0 (--device-ids 0 0).
# The dry run keeps the names and flags (but see dry_flags) and shrinks the sizes (2 envs per
# rank, at most 2 ranks).
ROWS = {
    "1×8 sync": (1, 8, []),
    # the default --bucket-mb: the all-reduce overlapped with backward (the compiled loss's graph
    # break); the same 8 envs and global batch as the 1×8 rows
    "2×4 native+bf16 compile gloo, one GPU": (2, 4, NATIVE_BF16 + COMPILE + ["--backend", "gloo"]),
    "1×8 native+bf16 compile": (1, 8, NATIVE_BF16 + COMPILE),
    "1×8 native+bf16 compile+graphs": (1, 8, NATIVE_BF16 + GRAPHS),
}
# The GPU plan, in run order: (step, cap in seconds). "wheels" is gpu_check.sh's pip install (its
# `timeout`), a row name a trainer row, "env" and "update" the ceilings. Most wanted first, so a
# run cut short keeps what matters; the caps plus RESERVE_S add up under TOTAL_S (tested), so each
# step gets its cap in time. A step may also use what the steps before it left unused, as long as
# the steps after it keep their caps (Check.budget). A compile row's cold Triton compile: 50-75 s.
GPU_STEPS = [
    ("wheels", 20),  # 7 small wheels, --no-deps --no-index: seconds
    ("preflight", 35),  # cold imports of torch and the trainer, CUDA init, nvidia-smi, lscpu
    ("1×8 sync", 35),
    ("2×4 native+bf16 compile gloo, one GPU", 105),  # two ranks compile at once
    ("1×8 native+bf16 compile", 80),
    ("1×8 native+bf16 compile+graphs", 80),
    ("env", 20),  # 4 cells, 2 x 0.5 s each
    ("update", 20),  # 2 minibatch sizes x fp32 / bf16, 0.5 s each
]
PROBE_S = 5  # each of preflight's nvidia-smi / lscpu calls, at most
PLATFORM = "torch / CUDA / driver / GPU"  # the summary's line naming what every figure ran on
DRY_CAPS = {"wheels": 20, "preflight": 60, "row": 90, "env": 30, "update": 30}


def kind(step):
    """A step's kind: wheels, preflight, env, update, or row."""
    return step if step in ("wheels", "preflight", "env", "update") else "row"


def dry_flags(ranks, flags):
    """A row's flags in the CPU dry run: no --cuda-graphs (the trainer refuses it off CUDA); only
    multi-rank rows compile (a 1-rank compile row adds no path a CPU can check; ~15 s each)."""
    drop = {"--cuda-graphs"} | ({"--compile"} if ranks == 1 else set())
    return [x for x in flags if x not in drop]


def plan(dry):
    """Sizes, steps in run order and their caps (seconds) of a GPU run or of the CPU dry run."""
    if dry:
        return dict(
            env_grid=[(8, 1)],
            env_seconds=0.2,  # each measurement
            minibatches=[32],
            update_seconds=0.2,
            rows={n: (min(r, 2), 2, dry_flags(r, f)) for n, (r, _, f) in ROWS.items()},
            num_steps=16,
            iterations=2,
            warmup_iterations=1,
            # one thread per process: OpenMP threads that spin on a shared, loaded machine make a
            # tiny run 10x slower
            trainer_flags=["--no-cuda", "--threads", "1", "--update-epochs", "1"],
            steps=[(s, DRY_CAPS[kind(s)]) for s, _ in GPU_STEPS],
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    return dict(
        # the trainer's ale-py threads on CUDA: the node's cores per rank. 1×8 rows, the 2×4
        # row's ranks, 64 envs, one thread
        env_grid=[(8, cores), (4, max(1, cores // 2)), (64, cores), (8, 1)],
        env_seconds=0.5,
        minibatches=[256, 2048],  # the trainer's at 8 envs (1024 / 4) and at 64 envs (8192 / 4)
        update_seconds=0.5,
        rows=dict(ROWS),
        num_steps=128,  # the trainer's default
        iterations=10,
        warmup_iterations=2,
        trainer_flags=[],
        steps=list(GPU_STEPS),
    )


# ================================================================================================
# WORKERS: each step's measurement, run as `gpu_check.py --worker NAME` in a process of its own;
# each prints `RESULT {json}` lines, one per measurement, as it goes
# ================================================================================================
def result(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def worker_preflight(a):
    import importlib
    import importlib.metadata

    import torch

    cuda = torch.cuda.is_available()
    gpus, names = [], []
    for i in range(torch.cuda.device_count() if cuda else 0):
        p = torch.cuda.get_device_properties(i)
        names.append(p.name)
        gpus.append(
            f"{p.name} (sm {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
            f"{p.multi_processor_count} SMs)"
        )
    driver = None  # the kernel module's version, without nvidia-smi
    with contextlib.suppress(OSError):
        found = re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text())
        driver = found and found[1]
    result(
        python=sys.version.split()[0],
        executable=sys.executable,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if cuda else None,
        driver=driver,
        cuda_available=cuda,
        gpus=gpus,
        gpu_names=names,
        bf16_supported=bool(cuda and torch.cuda.is_bf16_supported()),
        cores=os.cpu_count(),
        usable_cores=len(os.sched_getaffinity(0)),
        compilers={c: shutil.which(c) for c in (os.environ.get("CXX", "g++"), "gcc", "cc")},
    )
    packages = {}
    for dist in (
        "gymnasium ale-py tyro tensorboard numpy opencv-python-headless typing_extensions "
        "typeguard docstring_parser farama-notifications cloudpickle"
    ).split():
        try:
            packages[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            packages[dist] = None
    result(packages=packages)
    for name in ("gymnasium", "ale_py", "tyro", "tensorboard", "cv2"):
        try:
            module = importlib.import_module(name)
            result(module=name, ok=True, where=str(Path(module.__file__).parent))
        except Exception as e:
            result(module=name, ok=False, error=f"{type(e).__name__}: {e}")
    load_trainer()  # the trainer's own imports, all of them
    result(module="ppo_atari_multigpu.py", ok=True, where=str(TRAINER))


def steps_per_second(step, num_envs, n_actions, seconds):
    """Env steps per second (agent steps, 4 frames each) of `step` with random actions, after 10
    warm-up steps; at least `seconds` and 5 vector steps are timed."""
    import numpy as np

    actions = np.random.default_rng(0).integers(n_actions, size=(64, num_envs))
    for i in range(10):
        step(actions[i])
    count, start = 0, time.perf_counter()
    while True:
        step(actions[count % len(actions)])
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 5:
            return count * num_envs / elapsed


def worker_env(a):
    """ale-py's AtariVectorEnv as the trainer builds it (--env-backend native), alone and through
    the trainer's NativeVectorEnv wrapper (frame stack, infos)."""
    mod = load_trainer()
    env_id = mod.Args.env_id
    for envs, threads in plan(a.cpu_dry_run)["env_grid"]:
        try:
            native = mod.NativeVectorEnv(env_id, envs, threads, 4)
            n = native.single_action_space.n
            native.reset(seed=list(range(envs)))
            raw = steps_per_second(native.env.step, envs, n, a.seconds)
            native.reset(seed=list(range(envs)))  # the wrapper's state starts afresh
            wrapped = steps_per_second(native.step, envs, n, a.seconds)
            native.close()
            result(envs=envs, threads=threads, raw=raw, wrapped=wrapped)
        except Exception as e:
            result(envs=envs, threads=threads, error=f"{type(e).__name__}: {e}")


def update_rate(mod, device, n_actions, mbs, amp, seconds):
    """(minibatches timed, samples/s) of the trainer's update on random data: its Agent (with its
    speed_up), flat gradient buffer, precision(), minibatch_gradient and optimizer step sequence."""
    import numpy as np
    import torch

    targs = mod.Args(amp=amp)
    targs.minibatch_size, targs.world_size = mbs, 1  # as resolve_sizes sets them for one rank
    agent = mod.speed_up(mod.Agent((4, 84, 84), n_actions).to(device), targs)
    optimizer = torch.optim.Adam(agent.parameters(), lr=targs.learning_rate, eps=1e-5, foreach=True)
    params = list(agent.parameters())
    flat = mod.flat_grad_buffer(params, len(mod.LOSS_STATS))
    buckets = mod.GradBuckets(params, flat, targs.bucket_mb, 1)  # one rank: no collectives
    n = 4 * mbs  # 4 minibatches per epoch, as the trainer's default
    obs = torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, device=device)
    actions = torch.randint(0, n_actions, (n,), device=device)
    with torch.no_grad():  # the same policy's log-probs and values: ratios start near 1
        outs = [
            agent.get_action_and_value(obs[i : i + mbs], actions[i : i + mbs])
            for i in range(0, n, mbs)
        ]
    logprobs = torch.cat([o["logprob"] for o in outs])
    values = torch.cat([o["value"].flatten() for o in outs])
    advantages = torch.randn(n, device=device)
    batch = dict(obs=obs, actions=actions, logprobs=logprobs, advantages=advantages)
    batch |= dict(returns=values + advantages, values=values)
    autocast, scaler = mod.precision(targs, device)
    coef, rng = mod.loss_coefficients(targs, device), np.random.default_rng(0)

    def minibatch():
        mb_inds = torch.as_tensor(rng.choice(n, mbs, replace=False), device=device)
        mod.minibatch_gradient(agent, targs, coef, batch, mb_inds, buckets, autocast, scaler)
        buckets.wait()  # one rank: no collectives
        scaler.unscale_(optimizer)  # the trainer's step sequence
        torch.nn.utils.clip_grad_norm_(params, targs.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()

    def sync():  # only to read the clock
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):  # warm-up: kernel choice, allocator, Adam's state
        minibatch()
    sync()
    count, start = 0, time.perf_counter()
    while True:  # whole epochs of 4 minibatches
        for _ in range(4):
            minibatch()
        count += 4
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 8:
            return count, count * mbs / elapsed


def worker_update(a):
    """The update ceiling at each minibatch size, fp32 and bf16, on CUDA (CPU in the dry run)."""
    import torch

    mod = load_trainer()
    mod.keep_freed_memory()  # as the trainer does
    if a.cpu_dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # as the dry run's trainer rows
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        return result(error="CUDA is not available: no GPU update ceiling measured")
    torch.backends.cudnn.deterministic = mod.Args.torch_deterministic  # the trainer's default
    n_actions = mod.gym.make(mod.Args.env_id).action_space.n
    for mbs in plan(a.cpu_dry_run)["minibatches"]:
        for amp in ("none", "bf16"):
            row = dict(minibatch=mbs, amp=amp, device=str(device))
            try:
                count, rate = update_rate(mod, device, n_actions, mbs, amp, a.seconds)
                result(**row, minibatches=count, samples_per_s=rate)
            except Exception as e:
                result(**row, error=f"{type(e).__name__}: {e}")


WORKERS = {"preflight": worker_preflight, "env": worker_env, "update": worker_update}


# ================================================================================================
# DRIVER: the steps in order, bounded, each appended to summary.md as it ends
# ================================================================================================
class TimeUp(Exception):
    """gpu_check.sh's overall `timeout` sent SIGTERM."""


def on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up must not be interrupted
    raise TimeUp()


class Check:
    def __init__(self, a):
        self.a, self.out, self.dry = a, Path(a.out_dir), a.cpu_dry_run
        self.plan = plan(self.dry)
        self.deadline = a.deadline or time.time() + TOTAL_S - 5
        self.caps = dict(self.plan["steps"])
        self.sections = 0  # numbered in run order
        self.platform = {}  # preflight's: what every figure ran on
        self.results = {"mode": "cpu-dry-run" if self.dry else "gpu", "steps": {}, "rows": []}
        self.failures = []  # "step: why", for the exit code and the summary's last line
        self.cuda = False  # preflight's verdict
        self.time_up = False  # gpu_check.sh's overall `timeout` sent SIGTERM
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # trainer runs: never in OUT_DIR

    # ---- plumbing ----
    def md(self, *lines):
        with open(self.out / "summary.md", "a") as f:
            f.write("\n".join(lines) + "\n")

    def save_json(self):
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n")

    def section(self, title):
        self.sections += 1
        return ["", f"## {self.sections}. {title}", ""]

    def budget(self, step):
        """(seconds `step` may take, or None and why it must not start): its cap, and what the
        steps before it left unused as long as the steps after it keep their caps; never past
        the deadline less TABLE_S for the final table."""
        left = self.deadline - time.time() - TABLE_S
        if self.time_up:
            return None, "not run: the overall time limit stopped the check"
        if left < 10:
            return None, "not run: too little of the overall time limit was left"
        names = [name for name, _ in self.plan["steps"]]
        later = sum(cap for _, cap in self.plan["steps"][names.index(step) + 1 :])
        return min(left, max(self.caps[step], left - later)), None

    def run(self, cmd, log, timeout, cwd=None):
        """Run cmd, its stdout and stderr appended to `log`. Returns (exit code, or None when it
        was killed at `timeout` or by the overall limit (then self.time_up), seconds, the text
        it wrote): the step still reports what its process wrote before."""
        path = self.out / log
        with open(path, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            start = f.tell()
        env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
        t = time.time()
        with open(path, "a") as f:
            proc = subprocess.Popen(
                cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            rc = None
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            except TimeUp:
                self.time_up = True
            finally:  # a timeout or TimeUp: the whole tree goes (torchrun's ranks have sessions
                # of their own, so not os.killpg)
                if proc.poll() is None:
                    for pid in process_tree(proc.pid):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    proc.wait()
                    f.write(f"\n[gpu_check] killed after {time.time() - t:.0f} s\n")
        with open(path) as f:
            f.seek(start)
            return rc, time.time() - t, f.read()

    def worker(self, name, *extra, timeout=None):
        """One worker step (`timeout`: its budget's unless given): (its RESULT dicts, None or
        why it failed, seconds)."""
        if timeout is None:
            timeout, skip = self.budget(name)
            if skip:
                return [], skip, 0.0
        cmd = [sys.executable, str(Path(__file__).resolve()), str(self.out), "--worker", name]
        cmd += (["--cpu-dry-run"] if self.dry else []) + list(extra)
        rc, seconds, text = self.run(cmd, LOG[name], timeout)
        results = [json.loads(x[len("RESULT ") :]) for x in text.splitlines() if x[:7] == "RESULT "]
        why = None
        if self.time_up:
            why = "not finished: the overall time limit stopped it"
        elif rc is None:
            why = f"killed at its {timeout:.0f} s limit"
        elif rc != 0:
            why = f"exit {rc}: {error_line(text)}"
        return results, why, seconds

    def step_status(self, key, why, seconds):
        self.results["steps"][key] = {"seconds": round(seconds, 1), "error": why}
        if why:
            self.failures.append(f"{key}: {why}")
        self.save_json()
        return f"- {failed(why) if why else 'ok'} ({seconds:.0f} s; log: `{LOG[key]}`)"

    # ---- preflight ----
    def preflight(self):
        total, skip = self.budget("preflight")
        step_end = time.time() + (total or 0)
        timeout = max(5, total - 2 * PROBE_S) if total else None  # the probes get the rest
        results, why, seconds = (
            self.worker("preflight", timeout=timeout) if total else ([], skip, 0)
        )
        lines = self.section("Preflight")
        info = {k: v for r in results if "python" in r for k, v in r.items()}
        if info:
            lines += [
                f"- python {info['python']} (`{info['executable']}`); torch {info['torch']} "
                f"({'CUDA ' + info['torch_cuda'] if info['torch_cuda'] else 'a CPU-only'} build"
                f"{', cuDNN ' + str(info['cudnn']) if info.get('cudnn') else ''})",
                f"- CUDA available: {info['cuda_available']}; GPUs: "
                f"{'; '.join(info['gpus']) or 'none'}; bf16 supported: {info['bf16_supported']}",
                f"- cores: {info['cores']} ({info['usable_cores']} usable)",
                "- compilers (--compile: inductor's C++, Triton's launchers): "
                + ", ".join(f"{k} {v or 'MISSING'}" for k, v in info["compilers"].items()),
            ]
        for r in results:
            if "packages" in r:
                found = [f"{k} {v}" for k, v in r["packages"].items() if v]
                missing = [k for k, v in r["packages"].items() if not v]
                lines.append(f"- packages: {', '.join(found)}; not installed: {missing or 'none'}")
            if "module" in r:
                state = f"ok, from `{r['where']}`" if r["ok"] else f"FAILED: {r['error']}"
                lines.append(f"- import {r['module']}: {state}")
                if not r["ok"] and not why:
                    why = f"import {r['module']} failed"
        self.cuda = bool(info.get("cuda_available"))
        if not self.dry and not self.cuda and not why:
            why = "CUDA is not available"
        t = time.time()
        smi = self.machine(lines, step_end) if total else {}
        seconds += time.time() - t
        self.platform = platform(info, smi)
        self.results["platform"] = self.platform
        self.header(f"- {PLATFORM}: {platform_text(self.platform)}")
        self.results["preflight"] = {"results": results}
        self.md(*lines, self.step_status("preflight", why, seconds))

    def machine(self, lines, step_end):
        """nvidia-smi (if present) and lscpu, each at most PROBE_S and not past step_end: the
        full output to the log, key lines to `lines`. Returns nvidia-smi's GPU fields (first
        GPU) or {}."""
        fields, smi = {}, shutil.which("nvidia-smi")
        query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        probes = [["lscpu"]]
        if smi:  # the query first: the driver version names every GPU figure
            probes = [[smi, f"--query-gpu={query}", "--format=csv,noheader"], [smi]] + probes
        else:
            lines.append("- nvidia-smi: not on this machine")
        for cmd in probes:
            if shutil.which(cmd[0]) is None:
                lines.append(f"- {cmd[0]}: not on this machine")
                continue
            timeout = max(1, min(PROBE_S, step_end - time.time()))
            rc, _, text = self.run(cmd, LOG["preflight"], timeout)
            if len(cmd) > 1:
                lines.append(f"- nvidia-smi ({query}): {text.strip() or f'exit {rc}'}")
                values = (
                    [v.strip() for v in text.strip().splitlines()[0].split(",")] if text else []
                )
                if rc == 0 and len(values) == len(query.split(",")):
                    fields = dict(zip(query.split(","), values))
            elif cmd[0] == "lscpu":
                keep = ("Model name", "CPU(s)", "Thread(s) per core", "NUMA node(s)")
                got = [x.strip() for x in text.splitlines() if x.split(":")[0].strip() in keep]
                lines.append(f"- lscpu: {'; '.join(' '.join(x.split()) for x in got)}")
        return fields

    def header(self, line):
        """Put `line` in place of gpu_check.sh's PLATFORM line at the top of summary.md (or
        before its first section): every figure below names the torch and GPU it ran on."""
        path = self.out / "summary.md"
        text = path.read_text()
        found = re.search(rf"^- {PLATFORM}:.*$", text, re.M)
        if found:
            text = text[: found.start()] + line + text[found.end() :]
        else:
            i = text.find("\n## ")
            text = text + line + "\n" if i < 0 else text[: i + 1] + line + "\n" + text[i + 1 :]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    # ---- ceilings ----
    def env_ceiling(self):
        results, why, seconds = self.worker("env", "--seconds", str(self.plan["env_seconds"]))
        lines = [
            *self.section("Ceiling: env stepping (ale-py AtariVectorEnv, random actions)"),
            "Breakout, the trainer's AtariVectorEnv settings (--env-backend native); env steps/s "
            f"(one step = 4 frames), at least {self.plan['env_seconds']} s timed after 10 warm-up "
            "steps: alone, and through the trainer's NativeVectorEnv wrapper (frame stack, infos).",
            "",
            "| envs | threads | AtariVectorEnv steps/s | with the trainer's wrapper steps/s |",
            "|---|---|---|---|",
        ]
        for r in results:
            if "error" in r:
                lines.append(f"| {r['envs']} | {r['threads']} | FAILED: {r['error']} | |")
                why = why or f"{r['envs']} envs × {r['threads']} threads failed"
            else:
                lines.append(
                    f"| {r['envs']} | {r['threads']} | {r['raw']:.0f} | {r['wrapped']:.0f} |"
                )
        if not results and not why:
            why = "no result"
        self.results["env_ceiling"] = results
        self.md(*lines, "", self.step_status("env", why, seconds))

    def update_ceiling(self):
        results, why, seconds = self.worker("update", "--seconds", str(self.plan["update_seconds"]))
        lines = [
            *self.section("Ceiling: the trainer's update"),
            "Its Agent (channels-last), flat gradient buffer, precision() and minibatch_gradient, "
            "then unscale_, clip_grad_norm_, step, update, on random uint8 frames; whole epochs of "
            f"4 minibatches, at least {self.plan['update_seconds']} s timed after 3 warm-up "
            "minibatches (on CUDA the clock is read after torch.cuda.synchronize).",
            "",
            "| minibatch | precision | device | samples/s | minibatches timed |",
            "|---|---|---|---|---|",
        ]
        for r in results:
            if "minibatch" not in r:
                why = why or r["error"]
            elif "error" in r:
                lines.append(
                    f"| {r['minibatch']} | {r['amp']} | {r['device']} | FAILED: {r['error']} | |"
                )
                why = why or f"minibatch {r['minibatch']} {r['amp']} failed"
            else:
                lines.append(
                    f"| {r['minibatch']} | {'fp32' if r['amp'] == 'none' else r['amp']} | "
                    f"{r['device']} | {r['samples_per_s']:.0f} | {r['minibatches']} |"
                )
        if not results and not why:
            why = "no result"
        self.results["update_ceiling"] = results
        self.md(*lines, "", self.step_status("update", why, seconds))

    # ---- trainer rows ----
    def trainer_rows(self):
        p = self.plan
        self.md(
            *self.section("Trainer rows"),
            f"Short real runs: {p['iterations']} iterations of ranks × envs × {p['num_steps']} "
            f"steps, {shlex.join(['--eval-episodes', '0'] + p['trainer_flags'])}; ranks > 1 on "
            "the one GPU (--device-ids 0 0); one line per row as it ends (table: the last "
            "section)."
            + (
                " Dry run: rows named +graphs run without --cuda-graphs (CUDA only)."
                if self.dry
                else ""
            ),
            "",
        )
        start = time.time()
        for name in self.row_names():
            ranks, envs, flags = p["rows"][name]
            row = self.trainer_row(name, ranks, envs, flags)
            self.results["rows"].append(row)
            if "error" in row:
                self.failures.append(f"row {name}: {row['error']}")
                self.md(f"- {name} ({row['ran_as']}): {failed(row['error'])}")
            else:
                self.md(
                    f"- {name} ({row['ran_as']}, device {row['device']}, {row['threads']} "
                    f"thread(s) per rank): SPS {row['sps_run']} "
                    f"(whole run, done line), {fmt(row.get('sps_after_warmup'))} after warm-up "
                    f"({row['seconds']:.0f} s)"
                )
            self.save_json()
        self.results["steps"]["trainer"] = {"seconds": round(time.time() - start, 1)}
        self.md(f"- log: `{LOG['trainer']}`")

    def trainer_row(self, name, ranks, envs, flags):
        p = self.plan
        batch = ranks * envs * p["num_steps"]
        ran_as = f"{ranks}×{envs}×{p['num_steps']}"
        row = {"name": name, "ranks": ranks, "envs": envs, "ran_as": ran_as, "flags": flags}
        timeout, skip = self.budget(name)
        if skip:
            return dict(row, error=skip)
        if not self.dry and not self.cuda:
            return dict(row, error="not run: preflight found no CUDA")
        run_name = "gpu-check-" + re.sub(r"[^\w]+", "-", name).strip("-")
        launch = [sys.executable]
        if ranks > 1:
            launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
            flags = flags + ["--device-ids"] + ["0"] * ranks  # every rank on the one GPU
        cmd = (
            launch
            + [
                str(TRAINER),
                "--local-num-envs",
                str(envs),
                "--num-steps",
                str(p["num_steps"]),
                "--total-timesteps",
                str(p["iterations"] * batch),
                "--eval-episodes",
                "0",
                "--save-interval",
                "0",
                "--print-every",
                "0",
                "--run-name",
                run_name,
                *flags,
            ]
            + p["trainer_flags"]
        )
        with open(self.out / LOG["trainer"], "a") as f:
            f.write(f"\n==== {name} ({ran_as}) ====\n")
        rc, seconds, text = self.run(cmd, LOG["trainer"], timeout, cwd=self.tmp)
        row["seconds"] = round(seconds, 1)
        try:
            if self.time_up:
                return dict(row, error="not finished: the overall time limit stopped it")
            if rc is None:
                return dict(row, error=f"killed at its {timeout:.0f} s limit")
            if rc != 0:
                return dict(row, error=f"exit {rc}: {error_line(text)}")
            done = re.search(r"^done: (\d+) steps in [^,]*, SPS (\d+)", text, re.M)
            if not done:
                return dict(row, error="no `done: ... SPS N` line in its output")
            row["steps"], row["sps_run"] = int(done[1]), int(done[2])
            head = re.search(r"^run \S+: .*device (\w+), (\d+) thread", text, re.M)
            row["device"], row["threads"] = (head[1], int(head[2])) if head else ("?", None)
            row.update(self.read_events(self.tmp / "runs" / run_name, batch))
            return row
        except Exception as e:  # unreadable events: the done line still stands
            return dict(row, events_error=f"{type(e).__name__}: {e}")
        finally:
            shutil.rmtree(self.tmp / "runs" / run_name, ignore_errors=True)  # ~20 MB checkpoint

    def read_events(self, run_dir, batch):
        """SPS after warm-up from the wall times of consecutive charts/SPS events (the scalar
        itself is an average since the start), and rank 0's per-iteration seconds."""
        import numpy as np
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        events = acc.Scalars("charts/SPS")
        w = self.plan["warmup_iterations"]
        out = {"iterations": len(events), "sps_last_scalar": events[-1].value}
        if len(events) > w:
            wall = events[-1].wall_time - events[w - 1].wall_time
            out["sps_after_warmup"] = round(batch * (len(events) - w) / wall)

        def median(tag):
            if tag not in tags:
                return None
            return float(np.median([e.value for e in acc.Scalars(tag)][w:]))

        t = {k: median(f"perf/{k}_s/rank0") for k in ("rollout", "env", "update", "allreduce")}
        if None not in t.values():
            out["seconds_per_iteration"] = {
                "env": t["env"],
                "inference": t["rollout"] - t["env"],
                "update": t["update"] - t["allreduce"],
                "allreduce": t["allreduce"],
            }
        out["gpu_util"] = median("perf/gpu_util/rank0")
        return out

    def row_names(self):
        return [name for name, _ in self.plan["steps"] if kind(name) == "row"]

    # ---- the table ----
    def table(self, stopped):
        p, rows = self.plan, self.results["rows"]
        done = {r["name"] for r in rows}
        rows = rows + [
            {"name": n, "ran_as": f"{r}×{e}×{p['num_steps']}", "error": stopped or "not run"}
            for n in self.row_names()
            if n not in done
            for r, e, _ in [p["rows"][n]]
        ]
        w = p["warmup_iterations"]
        lines = [
            *self.section("Results table"),
            f"Ran on {platform_text(self.platform)}.",
            "",
            "Goals, for reference (not claims): ≥ 10,000 SPS at 8 envs; "
            "≥ 25,000 SPS at 64+ envs "
            "(envs of all ranks together).",
            "",
            "| row | ran as ranks×envs×steps | device | SPS, whole run (done line) | SPS after "
            f"warm-up (iterations {w + 1}–{p['iterations']}) | env s | inference s | update s | "
            "all-reduce s | GPU util % | goal SPS | goal met (after warm-up) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "sps_run" not in r:
                lines.append(f"| {r['name']} | {r['ran_as']} | {failed(r['error'])} |" + " |" * 9)
                continue
            s = r.get("seconds_per_iteration", {})
            total_envs = r["ranks"] * r["envs"]
            goal = GOALS[8] if total_envs <= 8 else GOALS[64] if total_envs >= 64 else None
            after = r.get("sps_after_warmup")
            if self.dry:
                met = "n/a (CPU dry run)"
            elif r["device"] != "cuda":
                met = f"n/a (ran on {r['device']})"
            elif goal is None or after is None:
                met = "–"
            else:
                met = "yes" if after >= goal else "no"
            cells = [fmt(s.get(k), 3) for k in ("env", "inference", "update", "allreduce")]
            lines.append(
                f"| {r['name']} | {r['ran_as']} | {r['device']} | {r['sps_run']} | {fmt(after)} | "
                + " | ".join(cells)
                + f" | {fmt(r.get('gpu_util'))} | {fmt(goal) if not self.dry else 'n/a'} | {met} |"
            )
        lines += [
            "",
            "SPS, whole run: the trainer's own `done: ... SPS N` (all steps / all seconds, "
            "start-up included). SPS after warm-up: steps / seconds between the charts/SPS "
            f"events of iteration {w} and the last. env / inference / update / all-reduce s: rank "
            "0's median seconds per iteration after warm-up (perf/* tags; inference = rollout − "
            "env, update = GAE + update − all-reduce). "
            "GPU util: the trainer's perf/gpu_util (– "
            "without pynvml).",
        ]
        best = {}
        for r in self.results.get("env_ceiling", []):
            if "raw" in r and r["raw"] > best.get(r["envs"], (0,))[0]:
                best[r["envs"]] = (r["raw"], r["threads"], r["wrapped"])
        if best:
            lines.append(
                "Env ceiling, best thread count per env count (its section above): "
                + "; ".join(
                    f"{e} envs: {v[0]:.0f} steps/s ({v[1]} thread(s); {v[2]:.0f} with the wrapper)"
                    for e, v in sorted(best.items())
                )
                + "."
            )
        upd = [r for r in self.results.get("update_ceiling", []) if "samples_per_s" in r]
        if upd:
            lines.append(
                "Update ceiling (its section above): "
                + "; ".join(
                    f"minibatch {r['minibatch']} {'fp32' if r['amp'] == 'none' else r['amp']}: "
                    f"{r['samples_per_s']:.0f} samples/s"
                    for r in upd
                )
                + "."
            )
        failures = self.failures + [f"row {r['name']}: {r['error']}" for r in rows if "error" in r]
        failures = list(dict.fromkeys(failures))
        lines += [
            "",
            f"Finished {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M:%S %Z}: "
            + (
                f"{len(failures)} problem(s): " + "; ".join(failures)
                if failures
                else "every step ok"
            )
            + ".",
        ]
        self.md(*lines)
        self.results["failures"] = failures
        self.save_json()
        return not failures

    def main(self):
        """Every step writes its section, also after the overall limit struck (then as not
        run); rows never reached are listed as such in the table."""
        stopped = None
        steps = {
            "preflight": self.preflight,
            "row": self.trainer_rows,  # all rows: one section
            "env": self.env_ceiling,
            "update": self.update_ceiling,
        }
        try:  # in the plan's order; "wheels" was gpu_check.sh's
            for k in dict.fromkeys(kind(name) for name, _ in self.plan["steps"]):
                if k in steps:
                    steps[k]()
        except TimeUp:  # struck between the steps' processes: the rest is not run
            self.time_up = True
            stopped = "not run: the overall time limit stopped the check"
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.time_up:
            self.failures.append("the overall time limit stopped the check")
        ok = self.table(stopped)
        return 124 if self.time_up else 0 if ok else 1


def platform(info, smi):
    """What the figures ran on, from preflight's worker (`info`) and nvidia-smi's query."""
    if not info:
        return {}
    names = info.get("gpu_names") or []
    return {
        "torch": info["torch"],
        "cuda": info["torch_cuda"],  # the CUDA torch was built with
        "driver": smi.get("driver_version") or info.get("driver"),
        "gpu": smi.get("name") or (names[0] if names else None),
        "gpus": len(names),
        "python": info["python"],
    }


def platform_text(p):
    if not p:
        return "unknown: preflight reported nothing (section 1)"
    cuda = f"CUDA {p['cuda']}" if p["cuda"] else "a CPU-only build"
    gpu = f"{p['gpu']} ×{p['gpus']}" if p["gpu"] else "none (no CUDA device)"
    driver = p["driver"] or "none found (nvidia-smi, /proc/driver/nvidia)"
    return f"torch {p['torch']} ({cuda}); driver {driver}; GPU {gpu}; python {p['python']}"


def failed(why):
    """What a step or row without numbers shows: skipped or cut short by the time limit, or
    failed."""
    return why if why.startswith(("not run", "not finished")) else f"FAILED: {why}"


def fmt(x, digits=0):
    if x is None:
        return "–"
    return f"{x:,.{digits}f}" if isinstance(x, float) or digits else f"{x:,}"


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out_dir")
    p.add_argument("--cpu-dry-run", action="store_true", help="CPU, tiny sizes, every step")
    p.add_argument("--deadline", type=float, help="epoch seconds by which to have finished")
    p.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)  # internal: one step
    p.add_argument("--seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return WORKERS[a.worker](a)
    signal.signal(signal.SIGTERM, on_sigterm)
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    print(f"gpu_check on {socket.gethostname()}: writing {a.out_dir}/summary.md", flush=True)
    sys.exit(Check(a).main())


if __name__ == "__main__":
    main()
