"""Throughput of ppo_atari_multigpu.py, side by side, in one invocation (run from anywhere):
    python benchmark/throughput.py [--iterations 30] [--repeats 3] [--only "2x4" ceiling ...]
        [--reference SCRIPT --reference-python PY]
Writes a markdown table to stdout and to benchmark/results/throughput-<host>.md; progress goes
to stderr.
Trainer configurations and ceilings (env stepping, update, all-reduce alone) run alternately
(A B C A B C ...), so slow drift of a shared machine hits every configuration alike.
With --reference, a CleanRL-style reference trainer (e.g. CleanRL's ppo_atari_multigpu.py, run by
its own interpreter PY, which has the packages it needs) joins the alternation once per layout
(ranks x envs) of the selected configurations, and every row gets its ratio to the reference
measured in this run, with the same SPS measure."""

import argparse
import datetime
import importlib.util
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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "ppo_atari_multigpu.py"
NUM_STEPS = 128  # trainer default steps per env per rollout: batch = ranks x envs x 128
WARMUP_ITERS = 2  # first iterations pay for allocation, caches and thread start-up
REF_SPS = 309  # the reference's 2x4 on this machine class: 306-312 SPS (used without --reference)
REFERENCE = "reference"  # name prefix of the reference rows: "reference 2x4"

# (name, ranks, envs per rank, flags); 1 rank runs under plain python, more under
# torchrun --standalone
VARIANTS = [
    ("default", []),
    ("no-channels-last", ["--no-channels-last"]),
    ("bf16", ["--amp", "bf16"]),
    ("compile", ["--compile"]),
    ("native", ["--env-backend", "native"]),
    ("async", ["--async-envs"]),
    ("native+bf16", ["--env-backend", "native", "--amp", "bf16"]),
    ("bf16+compile", ["--amp", "bf16", "--compile"]),
    ("native+bf16+compile", ["--env-backend", "native", "--amp", "bf16", "--compile"]),
    ("one-allreduce", ["--bucket-mb", "0"]),  # the gradients' all-reduce after backward, whole
]
CPU_CONFIGS = [
    (f"{layout} {variant}", ranks, envs, flags)
    for layout, ranks, envs in [("1x8", 1, 8), ("2x4", 2, 4), ("2x8", 2, 8)]
    for variant, flags in VARIANTS
]
# --gpu-set: one GPU shared by 1 or 4 ranks (4 ranks need gloo: nccl refuses two ranks on one GPU)
GPU_VARIANTS = [
    ("sync", []),
    ("native", ["--env-backend", "native"]),
    ("bf16", ["--amp", "bf16"]),
    ("native+bf16", ["--env-backend", "native", "--amp", "bf16"]),
]
GPU_CONFIGS = [
    (f"gpu {layout} {variant}", ranks, envs, base + flags)
    for layout, ranks, envs, base in [
        ("1x8", 1, 8, []),
        ("4x8 gloo", 4, 8, ["--backend", "gloo", "--device-ids", "0", "0", "0", "0"]),
    ]
    for variant, flags in GPU_VARIANTS
]
# (name, worker kind): each runs as `throughput.py --worker KIND` in its own process, like a
# trainer run
CEILINGS = [
    ("ceiling env sync 8 envs", "env"),
    ("ceiling env native 8 envs", "native"),
    ("ceiling update fp32", "update"),
    ("ceiling update bf16", "update-bf16"),
    ("ceiling all-reduce 2 gloo ranks", "allreduce"),
]


def load_trainer():
    sys.dont_write_bytecode = True  # no __pycache__ in the repo
    spec = importlib.util.spec_from_file_location("ppo_atari_multigpu", TRAINER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # the `__main__` block does not run: the name is not __main__
    return mod


# ---------------- ceiling workers (run in a child process; print one RESULT line) ----------------
def step_random(envs, num_envs, vector_steps=NUM_STEPS):
    """Env steps per second of `vector_steps` steps with random actions (one 1x8 rollout)."""
    envs.reset(seed=list(range(num_envs)))
    n = envs.single_action_space.n
    rng = np.random.default_rng(0)
    for _ in range(10):  # warm-up: first frames, FIRE resets
        envs.step(rng.integers(n, size=num_envs))
    t = time.perf_counter()
    for _ in range(vector_steps):
        envs.step(rng.integers(n, size=num_envs))
    return vector_steps * num_envs / (time.perf_counter() - t)


def worker_env(mod, a):
    import gymnasium as gym

    envs = gym.vector.SyncVectorEnv(
        [mod.make_env(a.env_id, i, False, "bench", mod.Args.frame_stack) for i in range(8)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    return {"env steps/s": step_random(envs, 8)}


def worker_native(mod, a):
    """ale-py's C++ vector env as the trainer wraps it (--env-backend native), with one thread
    and with all."""
    result = {}
    for t in sorted({1, os.cpu_count()}):
        envs = mod.NativeVectorEnv(a.env_id, 8, num_threads=t, frame_stack=mod.Args.frame_stack)
        result[f"env steps/s, {t} thread(s)"] = step_random(envs, 8)
    return result


def worker_update(mod, a, bf16):
    """The trainer's own minibatch_gradient + clip + Adam on random data: 4 epochs x 4 x 256,
    with the trainer's precision (bf16 autocast or none) and optimizer-step sequence."""
    import gymnasium as gym
    import torch

    # all cores: the best a single update can do
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    targs = mod.Args(
        local_num_envs=8,
        num_steps=NUM_STEPS,
        total_timesteps=8 * NUM_STEPS,
        amp="bf16" if bf16 else "none",
    )
    mod.resolve_sizes(targs, 1)
    n_actions, n = gym.make(a.env_id).action_space.n, targs.local_batch_size
    obs_shape = (targs.frame_stack, 84, 84)  # what the trainer's envs give
    agent = mod.speed_up(mod.Agent(obs_shape, n_actions).to(device), targs)  # as the trainer
    optimizer = torch.optim.Adam(agent.parameters(), lr=targs.learning_rate, eps=1e-5, foreach=True)
    params = list(agent.parameters())
    flat = mod.flat_grad_buffer(params, len(mod.LOSS_STATS))
    buckets = mod.GradBuckets(params, flat, targs.bucket_mb, 1)  # one rank: no collectives
    coef = mod.loss_coefficients(targs, device)
    obs = torch.randint(0, 256, (n, *obs_shape), dtype=torch.uint8, device=device)
    actions = torch.randint(0, n_actions, (n,), device=device)
    with torch.inference_mode():  # log-probs and values of the same policy: ratios start near 1
        out = agent.get_action_and_value(obs, actions)
    logprobs, values = out["logprob"].clone(), out["value"].flatten().clone()
    advantages = torch.randn(n, device=device)
    batch = dict(obs=obs, actions=actions, logprobs=logprobs, advantages=advantages)
    batch |= dict(returns=values + advantages, values=values)
    autocast, scaler = mod.precision(targs, device)  # as the trainer: bf16 autocast or none
    times = []
    for _ in range(1 + 3):  # one warm-up update, then three timed ones
        t = time.perf_counter()
        for _ in range(targs.update_epochs):
            # as the trainer: the permutation goes to the device once per epoch
            inds = torch.as_tensor(np.random.permutation(n), device=device)
            for start in range(0, n, targs.local_minibatch_size):
                mb_inds = inds[start : start + targs.local_minibatch_size]
                mod.minibatch_gradient(
                    agent, targs, coef, batch, mb_inds, buckets, autocast, scaler
                )
                buckets.wait()  # one rank: no collectives
                # the trainer's step sequence (the scaler acts under fp16 only)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, targs.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {"update samples/s": n / float(np.median(times[1:]))}


def allreduce_rank(rank, port, shapes, extra, out_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flat = torch.ones(sum(int(np.prod(s)) for s in shapes) + extra)  # what the trainer sends
    tensors = [torch.ones(s) for s in shapes]  # what a per-parameter all-reduce would send
    flat_ms, per_ms = [], []
    for _ in range(5 + 50):  # 5 warm-ups; the two ways alternate, so drift hits both alike
        dist.barrier()  # both ranks start together: the time is the collective, not a peer's lag
        t = time.perf_counter()
        dist.all_reduce(flat)
        flat_ms.append(1e3 * (time.perf_counter() - t))
        dist.barrier()
        t = time.perf_counter()
        for x in tensors:
            dist.all_reduce(x)
        per_ms.append(1e3 * (time.perf_counter() - t))
    if rank == 0:
        result = {
            "flat all_reduce ms": float(np.median(flat_ms[5:])),
            f"per-tensor all_reduce ms ({len(shapes)} tensors)": float(np.median(per_ms[5:])),
        }
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def worker_allreduce(mod, a):
    import gymnasium as gym
    import torch.multiprocessing as mp

    agent = mod.Agent((mod.Args.frame_stack, 84, 84), gym.make(a.env_id).action_space.n)
    shapes = [tuple(p.shape) for p in agent.parameters()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        mp.spawn(allreduce_rank, args=(port, shapes, len(mod.LOSS_STATS), out), nprocs=2)
        return json.loads(Path(out).read_text())


def run_worker(a):
    mod = load_trainer()
    mod.keep_freed_memory()  # as the trainer does
    fns = {
        "env": worker_env,
        "native": worker_native,
        "allreduce": worker_allreduce,
        "update": lambda m, a: worker_update(m, a, False),
        "update-bf16": lambda m, a: worker_update(m, a, True),
    }
    print("RESULT " + json.dumps(fns[a.worker](mod, a)), flush=True)


# ---------------- harness ----------------
def process_tree(root):
    """root and all its descendants. Not os.killpg: torchrun starts every rank in a session of
    its own."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            ppid = int(Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        except (ValueError, OSError, IndexError):
            pass  # not a process, or it just ended
    tree = [root]
    for pid in tree:
        tree += children.get(pid, [])
    return tree


def kill_tree(root):
    for pid in process_tree(root):  # parents first: none can start a replacement child
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_bounded(cmd, cwd, timeout, foreign=False):
    """(returncode, stdout, stderr); a run past `timeout` is killed with all its descendants
    (torchrun's ranks). foreign: another interpreter (the reference's), which must not see this
    environment's Python path settings."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    if foreign:
        for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(key, None)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        return -9, out, err + f"\ntimed out after {timeout}s"


def error_line(stderr):
    """The trainer's own `error [rank r]: ...` line says what failed, else the last exception line;
    torchrun's ChildFailedError summary after it is boilerplate ("error_file: <N/A>")."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    trainer = [line for line in lines if re.match(r"error( \[rank \d+\])?: ", line)]
    exception = re.compile(r"[\w.]+(Error|Exception|Expired)\b.*: \S")
    raised = [line for line in lines if exception.match(line) and "ChildFailed" not in line]
    return (trainer or raised or lines or ["(no stderr)"])[-1][:200]


def read_run(logdir, batch):
    """Per-iteration seconds from the wall times of consecutive charts/SPS events (the logged SPS
    value is a running average since start), and the per-rank perf/* timings, all without
    warm-up."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if "charts/SPS" not in tags:
        raise ValueError("no charts/SPS events")
    iter_s = np.diff([e.wall_time for e in acc.Scalars("charts/SPS")])[WARMUP_ITERS - 1 :]
    if len(iter_s) == 0:
        raise ValueError(f"too few iterations to skip {WARMUP_ITERS} warm-up ones")
    perf = {}  # (key, rank) -> per-iteration seconds
    for tag in tags:
        m = re.fullmatch(r"perf/(\w+)_s/rank(\d+)", tag)
        if m:
            perf[m[1], int(m[2])] = np.array([e.value for e in acc.Scalars(tag)])[WARMUP_ITERS:]
    ranks = sorted({r for _, r in perf})
    parts = {}
    if 0 in ranks and all(
        (k, r) in perf for k in ("rollout", "env", "update", "allreduce") for r in ranks
    ):
        per_rank = {
            r: {
                "env": perf["env", r],
                "inference": perf["rollout", r] - perf["env", r],
                "update": perf["update", r] - perf["allreduce", r],
                "allreduce": perf["allreduce", r],
            }
            for r in ranks
        }
        for k in ("env", "inference", "update", "allreduce"):
            parts[k] = (per_rank[0][k], np.max([per_rank[r][k] for r in ranks], axis=0))
    return {"sps": batch * len(iter_s) / iter_s.sum(), "parts": parts}


def fmt_range(values, digits=0):
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}" if values else "–"


def ratio_cell(results, ref_results):
    """median SPS / the reference's median SPS (same layout, this run), and with several repeats
    the range of the per-repeat ratios (repeat i of one against repeat i of the other: the runs
    nearest in time)."""
    if ref_results is None:
        return "–"
    ref_sps = [r["sps"] for r in ref_results if "sps" in r]
    sps = [r["sps"] for r in results if "sps" in r]
    if not ref_sps or not sps:
        return "– (no reference SPS)" if not ref_sps else "–"
    cell = f"{np.median(sps) / np.median(ref_sps):.2f}"
    paired = [
        a["sps"] / b["sps"] for a, b in zip(results, ref_results) if "sps" in a and "sps" in b
    ]
    if len(paired) > 1:
        cell += f" ({fmt_range(paired, 2)})"
    return cell


def trainer_row(name, ranks, envs, results, skipped, ref_results=None, measured_ref=False):
    """One table row. measured_ref: the ratio column is to the reference measured in this run
    (ref_results: its runs of this layout, or None), else to the fixed REF_SPS."""
    head = f"| {name} | {ranks}×{envs} |"
    if skipped:
        return head + f" not available ({skipped}) | | | | | | |"
    ok = [r for r in results if "sps" in r]
    failed = [r["error"] for r in results if "error" in r]
    note = f" ({len(failed)}/{len(results)} FAILED: {failed[-1]})" if failed else ""
    if not ok:
        return head + f" FAILED: {failed[-1] if failed else 'not run'} | | | | | | |"
    sps = [r["sps"] for r in ok]
    ratio = ratio_cell(results, ref_results) if measured_ref else f"{np.median(sps) / REF_SPS:.2f}"
    if name.startswith(REFERENCE):
        return (
            head + f" {np.median(sps):.0f}{note} | {fmt_range(sps)} | {ratio} | "
            "none: the reference logs no per-part timings | | | |"
        )
    cells = []
    for k in ("env", "inference", "update", "allreduce"):
        if not all(k in r["parts"] for r in ok):
            cells.append("–")
            continue
        r0, mx = (np.median(np.concatenate([r["parts"][k][i] for r in ok])) for i in (0, 1))
        cells.append(f"{r0:.3f}" if ranks == 1 else f"{r0:.3f} / {mx:.3f}")
    return (
        head
        + f" {np.median(sps):.0f}{note} | {fmt_range(sps)} | {ratio} | "
        + " | ".join(cells)
        + " |"
    )


def launcher(python, ranks):
    """1 rank: plain python; more: torchrun --standalone (as the same module of that python)."""
    return [python] + (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        if ranks > 1
        else []
    )


def run_name_of(name, rep):
    return f"bench-{name.replace(' ', '-').replace('+', '-')}-{rep}"


def run_trainer(job, rep, a, tmp):
    name, ranks, envs, flags = job
    run_name = run_name_of(name, rep)
    launch = launcher(sys.executable, ranks)
    batch = ranks * envs * NUM_STEPS
    cmd = (
        launch
        + [
            str(TRAINER),
            "--env-id",
            a.env_id,
            "--local-num-envs",
            str(envs),
            *flags,
            "--total-timesteps",
            str(a.iterations * batch),
            "--eval-episodes",
            "0",
            "--save-interval",
            "0",
            "--run-name",
            run_name,
        ]
        + ([] if a.cuda else ["--no-cuda"])
    )
    rc, _, err = run_bounded(cmd, tmp, a.timeout)
    try:
        return (
            read_run(Path(tmp, "runs", run_name), batch) if rc == 0 else {"error": error_line(err)}
        )
    except Exception as e:  # a run that exits 0 but logged nothing usable
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        # its checkpoint alone is ~20 MB
        shutil.rmtree(Path(tmp, "runs", run_name), ignore_errors=True)


def reference_cmd(a, ranks, envs, run_name, cuda_flags):
    """The reference's launch: CleanRL's flags (tyro: --env-id, --local-num-envs, --num-steps,
    --total-timesteps, --exp-name); cuda_flags turn CUDA off (its tyro version decides the
    spelling, see probe_reference)."""
    return launcher(a.reference_python, ranks) + [
        a.reference,
        "--env-id",
        a.env_id,
        "--local-num-envs",
        str(envs),
        "--num-steps",
        str(NUM_STEPS),
        "--total-timesteps",
        str(a.iterations * ranks * envs * NUM_STEPS),
        *([] if a.cuda else cuda_flags),
        "--exp-name",
        run_name,
    ]


REFERENCE_VERSIONS = (
    "import json, importlib.metadata as m\n"
    "v = {}\n"
    "for p in ('torch', 'gymnasium', 'ale-py', 'numpy', 'tyro'):\n"
    "    try:\n"
    "        v[p] = m.version(p)\n"
    "    except m.PackageNotFoundError:\n"
    "        v[p] = 'absent'\n"
    "print(json.dumps(v))"
)


def probe_reference(a, cwd):
    """The reference's --help (which flag turns CUDA off; the flags we pass must exist), the
    package versions of its interpreter and the script's sha256; exits on a missing flag."""
    import hashlib

    rc, help_text, err = run_bounded(
        [a.reference_python, a.reference, "--help"], cwd, 300, foreign=True
    )
    if rc != 0:
        sys.exit(f"reference `--help` failed: {error_line(err)}")
    for flag in ("--env-id", "--local-num-envs", "--num-steps", "--total-timesteps", "--exp-name"):
        if not re.search(rf"(?<![\w-]){flag}(?![\w-])", help_text):
            sys.exit(f"the reference has no {flag} in its --help: not a CleanRL-style trainer?")
    # tyro >= 0.5 spells a default-True bool as --cuda/--no-cuda; older tyro as --cuda {True,False}
    no_cuda = re.search(r"(?<![\w-])--no-cuda(?![\w-])", help_text)
    cuda_flags = ["--no-cuda"] if no_cuda else ["--cuda", "False"]
    rc, out, err = run_bounded([a.reference_python, "-c", REFERENCE_VERSIONS], cwd, 120, True)
    versions = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {}
    sha = hashlib.sha256(Path(a.reference).read_bytes()).hexdigest()[:12]
    return {"cuda_flags": cuda_flags, "versions": versions, "sha256": sha}


def run_reference(job, rep, a, tmp, cuda_flags):
    """One reference run in a folder of its own (it writes runs/<env>__<exp name>__<seed>__<time>
    in its working directory); the same SPS measure as ours, from its charts/SPS events."""
    name, ranks, envs, _ = job
    run_name = run_name_of(name, rep)
    cwd = Path(tmp, run_name)
    cwd.mkdir()
    try:
        cmd = reference_cmd(a, ranks, envs, run_name, cuda_flags)
        rc, _, err = run_bounded(cmd, cwd, a.timeout, foreign=True)
        if rc != 0:
            return {"error": error_line(err)}
        logdirs = sorted(Path(cwd, "runs").glob(f"*__{run_name}__*"))
        if len(logdirs) != 1:
            return {"error": f"expected one runs/*__{run_name}__* folder, found {len(logdirs)}"}
        return read_run(logdirs[0], ranks * envs * NUM_STEPS)
    except Exception as e:  # a run that exits 0 but logged nothing usable
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(cwd, ignore_errors=True)


def reference_configs(configs):
    """One reference configuration per layout (ranks x envs) of the selected ones, in order."""
    layouts = dict.fromkeys((ranks, envs) for _, ranks, envs, _ in configs)
    return [(f"{REFERENCE} {r}x{e}", r, e, []) for r, e in layouts]


def shown_argv(argv):
    """sys.argv for the results file, with the reference's path and interpreter as placeholders:
    they are machine-specific, and the results file is part of the repository."""
    shown, hide = [], {"--reference": "SCRIPT", "--reference-python": "PY"}
    for i, arg in enumerate(argv):
        key = arg.split("=", 1)[0]
        if key in hide and "=" in arg:
            shown.append(f"{key}={hide[key]}")
        elif i > 0 and argv[i - 1] in hide:
            shown.append(hide[argv[i - 1]])
        else:
            shown.append(arg)
    return shown


def run_ceiling(kind, a, tmp):
    """A ceiling runs in a fresh process, like a trainer run: same start-up state, and a crash
    stays there."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--env-id", a.env_id]
    rc, out, err = run_bounded(cmd + (["--cuda"] if a.cuda else []), tmp, a.timeout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if rc != 0 or not lines:
        return {"error": error_line(err)}
    return json.loads(lines[-1][len("RESULT ") :])


# set in the environment, they change what is measured: named before the command in the report
ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")


def report(a, configs, ceilings, results, skipped, started, load_before, ref=None):
    """ref: probe_reference's answer when --reference was given; then configs include the
    reference configurations."""
    import torch

    with open("/proc/cpuinfo") as f:
        models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = models[0] if models else "unknown"
    minutes = (time.time() - started.timestamp()) / 60
    usable = len(os.sched_getaffinity(0))
    device = "cuda" if a.cuda else "cpu"
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ISA_VARS if k in os.environ]
    md = [
        f"# Throughput of ppo_atari_multigpu.py on {a.host}"
        + (" beside the reference trainer" if ref else ""),
        "",
        f"- date: {started:%Y-%m-%d %H:%M %Z}, took {minutes:.1f} min",
        f"- host: {a.host}; CPU: {cpu}; cores: {os.cpu_count()} ({usable} usable); "
        f"load average before / after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}",
        f"- torch {torch.__version__}; env {a.env_id}; {a.iterations} iterations per run, "
        f"{a.repeats} repeat(s), first {WARMUP_ITERS} iterations skipped; device: {device}",
        "- command: `"
        + " ".join(
            env + [shlex.quote(x) for x in [Path(sys.executable).name, *shown_argv(sys.argv)]]
        )
        + "`",
    ]
    if ref:
        versions = ", ".join(f"{k} {v}" for k, v in ref["versions"].items()) or "unknown"
        example = reference_cmd(a, 2, 4, "NAME", ref["cuda_flags"])
        example[0], example[example.index(a.reference)] = "PY", "SCRIPT"
        md += [
            f"- reference: SCRIPT (sha256 {ref['sha256']}…) under its own interpreter PY "
            f"({versions}); a 2×4 run: `{' '.join(shlex.quote(x) for x in example)}`, "
            "in a scratch folder",
        ]
    md.append("")
    if configs:
        ratio_head = "×reference¹ (measured in this run)" if ref else "×ref¹"
        md += [
            f"| configuration | ranks×envs | SPS median | SPS min–max | "
            f"{ratio_head} | env s² | "
            "inference s² | update compute s² | all-reduce s² |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        md += [
            trainer_row(
                name,
                ranks,
                envs,
                results[name],
                skipped.get(name),
                results.get(f"{REFERENCE} {ranks}x{envs}"),
                measured_ref=bool(ref),
            )
            for name, ranks, envs, _ in configs
        ]
        md += [""]
        if ref:
            md.append(
                "¹ SPS median / the SPS median of the reference row with the same ranks×envs, "
                "both from this invocation (runs alternated); in brackets, with several repeats: "
                "min–max of the per-repeat ratios (repeat i of this row / repeat i of the "
                "reference)."
            )
        else:
            md.append(
                f"¹ SPS median / {REF_SPS}: the reference trainer ran 306–312 SPS as 2x4 "
                "(2 ranks × 4 envs) on this machine class."
            )
        md += [
            "SPS of a run = its steps / its seconds after warm-up (from the wall times of "
            "consecutive charts/SPS events); median and min–max over repeats.",
            "² Median seconds per iteration, pooled over repeats; with several ranks: "
            "rank 0 / max "
            "over ranks (per iteration). inference = rollout − env (policy forward, copies, "
            "storage); update compute = GAE + update − all-reduce; "
            "all-reduce = the collectives of "
            "the update (gradients and advantage statistics), waiting for a slower rank included."
            + (" The reference logs no per-part timings, only charts/SPS." if ref else ""),
            "",
        ]
    if ceilings:
        md += ["| ceiling | measure | median | min–max |", "|---|---|---|---|"]
        for name, _ in ceilings:
            runs = results[name]
            if any("skipped" in r for r in runs):
                md.append(f"| {name} | skipped: {runs[0]['skipped']} | | |")
            elif not any("error" not in r for r in runs):
                md.append(f"| {name} | FAILED: {runs[-1]['error'] if runs else 'not run'} | | |")
            else:
                ok = [r for r in runs if "error" not in r]
                note = f" ({len(runs) - len(ok)}/{len(runs)} FAILED)" if len(ok) < len(runs) else ""
                md += [
                    f"| {name} | {k}{note} | {np.median([r[k] for r in ok]):.1f} | "
                    f"{fmt_range([r[k] for r in ok], 1)} |"
                    for k in ok[0]
                ]
        md += [
            "",
            "env: random actions, 8 envs × 128 steps after 10 warm-up steps. update: the "
            "trainer's minibatch_gradient + clip + Adam, 4 epochs × 4 minibatches of 256 random "
            "samples, all cores; samples/s = 1024 / seconds of the full update (median of 3). "
            "all-reduce: 2 gloo ranks on 127.0.0.1, the Agent's gradient as one flat buffer vs one "
            "call per parameter tensor; median of 50 after 5 warm-ups.",
            "",
        ]
    return "\n".join(md)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--iterations", type=int, default=30, help="trainer iterations per run (128 steps per env)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    p.add_argument(
        "--only", nargs="+", metavar="SUBSTR", help="run only names containing one of these"
    )
    p.add_argument("--host", default=socket.gethostname(), help="names the results file")
    p.add_argument("--cuda", action="store_true", help="let the trainer use CUDA (drops --no-cuda)")
    p.add_argument(
        "--gpu-set",
        action="store_true",
        help="run the GPU configurations instead of the CPU ones (implies --cuda)",
    )
    p.add_argument(
        "--timeout", type=float, default=900, help="seconds one run may take before it is killed"
    )
    p.add_argument(
        "--reference",
        metavar="SCRIPT",
        help="a CleanRL-style reference trainer (e.g. CleanRL's ppo_atari_multigpu.py) to run in "
        "the alternation, once per layout of the selected configurations",
    )
    p.add_argument(
        "--reference-python",
        metavar="PY",
        help="the interpreter that runs --reference (its own venv: it needs its own gymnasium / "
        "ale-py versions); required with --reference",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one ceiling in this process
    a = p.parse_args()
    a.cuda = a.cuda or a.gpu_set
    if a.worker:
        return run_worker(a)
    if bool(a.reference) != bool(a.reference_python):
        p.error("--reference and --reference-python go together")
    if a.reference:
        # absolute, as runs start elsewhere; not resolved: a venv's python is a symlink whose
        # target would lose the venv
        a.reference, a.reference_python = map(os.path.abspath, (a.reference, a.reference_python))
        if not os.path.isfile(a.reference):
            p.error(f"--reference: no such file: {a.reference}")
        if not os.access(a.reference_python, os.X_OK):
            p.error(f"--reference-python: not an executable: {a.reference_python}")

    def wanted(name):
        return not a.only or any(s in name for s in a.only)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    configs = [c for c in (GPU_CONFIGS if a.gpu_set else CPU_CONFIGS) if wanted(c[0])]
    ceilings = [c for c in CEILINGS if wanted(c[0])]
    # opt-in flags may not exist in this version of the trainer: skip those configurations, don't
    # fail them
    skipped = {}
    if configs:
        rc, help_text, err = run_bounded([sys.executable, str(TRAINER), "--help"], REPO, 120)
        if rc != 0:
            sys.exit(f"`{TRAINER.name} --help` failed: {error_line(err)}")
        for name, _, _, flags in configs:
            options = [f for f in flags if f.startswith("--")]
            absent = [f for f in options if not re.search(rf"(?<![\w-]){f}(?![\w-])", help_text)]
            if absent:
                skipped[name] = f"no {' '.join(absent)} in the trainer's --help"
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    # the trainer's runs/ land here, not in the repo
    tmp = tempfile.mkdtemp(prefix="ppo-throughput-")
    ref, references = None, []
    if a.reference and configs:
        ref = probe_reference(a, tmp)
        log(f"reference: sha256 {ref['sha256']}, {ref['versions']}, CUDA off: {ref['cuda_flags']}")
        references = reference_configs(configs)
        configs = references + configs
    results = {name: [] for name, *_ in configs + ceilings}
    jobs = [c for c in configs if c[0] not in skipped] + ceilings
    try:
        # A B C, C B A, A B C ...: steady drift of a shared machine hits every job alike
        for rep in range(a.repeats):
            for i, job in enumerate(jobs if rep % 2 == 0 else jobs[::-1]):
                log(f"[repeat {rep + 1}/{a.repeats}, {i + 1}/{len(jobs)}] {job[0]} ...")
                t = time.time()
                if job in references:
                    res = run_reference(job, rep, a, tmp, ref["cuda_flags"])
                elif len(job) == 4:
                    res = run_trainer(job, rep, a, tmp)
                else:
                    res = run_ceiling(job[1], a, tmp)
                results[job[0]].append(res)
                summary = ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k}: {v}"
                    for k, v in res.items()
                    if k != "parts"
                )
                log(f"    {time.time() - t:.1f} s: {summary}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(a, configs, ceilings, results, skipped, started, load_before, ref)
    print(text)
    out = REPO / "benchmark" / "results" / f"throughput-{a.host}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
