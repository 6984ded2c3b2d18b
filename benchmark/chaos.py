"""Chaos soak (issue 41): the README's 2-rank CPU run under torchrun with `--resume auto`, hit by
real faults at random moments drawn from a seed, then checked from the run's own files.

    python benchmark/chaos.py --minutes 30 --seed 1 [--out FILE] [-- extra trainer flags]

First a fault-free warm-up (~60 s in its own directory) measures the steady SPS from the wall
times of its charts/SPS events (`--warmup-sps N` gives it instead). Then the soak: the run lives
in a temporary directory whose runs/ is a small tmpfs (mounted here: root only, else the full-disk
fault is left out), and 30-90 s after the run has recovered from the last fault comes the next
(gap, target and duration drawn from random.Random(seed); the kinds in a seeded order, each once
before any comes again):
  kill_rank      SIGKILL of a worker rank: torchrun restarts the group (--max-restarts=3)
  stop_rank      SIGSTOP of a rank past the failure board's limit (10 s), then SIGCONT
  preempt        SIGTERM to torchrun: the ranks save and exit 75
  kill_launcher  SIGKILL of torchrun: the orphaned ranks save and exit 75
  full_disk      runs/ filled to the last byte for 20-40 s, then freed
Whenever torchrun has exited, the same command is launched again, as a scheduler's requeue. A
fault is recovered once a start after it passes the step the run had reached (full disk: once a
checkpoint is saved after the disk is freed). At the end a SIGTERM stops the run, and the checks:
that stop saved and exited 75; every checkpoint loads (the trainer's `load_checkpoint`);
TensorBoard holds charts/SPS exactly once for every iteration; the final checkpoint is the last
step logged; no process or lock is left; every fault was recovered; and the goodput, final
checkpointed step / (warm-up SPS x soak seconds), is at least 0.8. A markdown report goes to
--out (default benchmark/results/chaos-seed<S>.md) and a summary line to stdout; the exit code is
0 only if every check passes. Run it niced on a shared machine: `nice -n 5 python ...`.
"""

import argparse
import ctypes
import datetime
import errno
import fcntl
import importlib.util
import logging
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "ppo_atari_multigpu.py"
RANKS, ENVS, STEPS = 2, 2, 32
BATCH = RANKS * ENVS * STEPS  # global steps per iteration: about 1 s on a 2-core VM
RUN = "chaos"
KINDS = ("kill_rank", "stop_rank", "preempt", "kill_launcher", "full_disk")
TMPFS_SIZE = "160m"  # 3 kept checkpoints of 19.4 MiB, a fourth being written, the events
RECOVERY_LIMIT = 300  # s: a run not past its step by then is called hung and killed
GOODPUT_BAR = 0.8
ITER_LINE = re.compile(r"^iter \d+/\d+ \| step (\d+) ")
PREEMPTED_LINE = re.compile(r"^preempted \((.*)\): saved (\S+); exit 75")
NOTABLE = ("error [", "preempted (", "warning: ", "resumed ", "stopped at once")


def trainer_command(extra):
    """The README's CPU launch, ~1 s an iteration here, with --resume auto and frequent saves."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc_per_node={RANKS}", "--max-restarts=3"]
    flags = f"--no-cuda --local-num-envs {ENVS} --num-steps {STEPS} --update-epochs 1 "
    flags += "--num-minibatches 2 --total-timesteps 1000000000 --resume auto "
    flags += f"--run-name {RUN} --save-minutes 0.5 --save-interval 5 --eval-episodes 0 "
    flags += "--print-every 0"  # a line every iteration: the soak follows the run by them
    return [*launcher, str(TRAINER), *flags.split(), *extra]


def worker_pids(launcher_pid):
    """{RANK: pid} of torchrun's children, by the RANK in their environment."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            found[int(env[b"RANK"])] = int(entry)
        except (OSError, ValueError, KeyError, IndexError):
            pass
    return found


def alive(pid):
    """Running or stopped; False when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Job:
    """The run's launches, one at a time, in `workdir`: launch N writes launch-N.log there, read as
    it grows for the trainer's lines (its starts, its steps)."""

    def __init__(self, workdir, cmd):
        self.workdir, self.cmd, self.proc, self.launches = workdir, cmd, None, []
        self.step, self.starts, self.ready, self.workers, self.pos = 0, 0, False, {}, 0
        self.notes = []  # (time seen, line): the trainer's errors, warnings, saves and resumes

    def launch(self):
        log = self.workdir / f"launch-{len(self.launches) + 1}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # its own session: the end's check finds any process of it still alive
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=self.workdir,
                stdout=out,
                env=env,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.launches.append({"pid": self.proc.pid, "log": log, "code": None, "workers": None})
        self.pos, self.workers, self.ready = 0, {}, False

    def poll(self):
        """Read the new lines of the log; True while torchrun runs."""
        with open(self.launches[-1]["log"], "rb") as f:
            f.seek(self.pos)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]  # a line still being written waits for its end
        self.pos += len(data)
        for line in data.decode(errors="replace").splitlines():
            if f"run {RUN}: " in line:  # the setup line: one per start of the ranks
                self.starts, self.ready = self.starts + 1, False
            elif m := ITER_LINE.match(line):
                self.step, self.ready = int(m[1]), True
            elif line.startswith(NOTABLE):
                self.notes.append((time.time(), line))
        running = self.proc.poll() is None
        if running:
            self.workers = worker_pids(self.proc.pid) or self.workers
        return running

    def reap_workers(self, limit=120):
        """Wait for the last launch's workers (orphans come to us, the subreaper): exit codes."""
        codes, deadline = {}, time.time() + limit
        for rank, pid in sorted(self.workers.items()):
            while rank not in codes and time.time() < deadline:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[rank] = os.waitstatus_to_exitcode(status)
                except ChildProcessError:  # torchrun's child, reaped by torchrun
                    if not alive(pid):
                        codes[rank] = "-"
                time.sleep(0.2)
        return codes

    def keep_running(self):
        """Relaunch if torchrun has exited, as a scheduler requeues a job; True if it had."""
        if self.poll():
            return False
        self.poll()  # the lines it wrote last
        last = self.launches[-1]
        last["code"], last["workers"] = self.proc.returncode, self.reap_workers()
        self.launch()
        return True

    def lines(self, launch=-1):
        return Path(self.launches[launch]["log"]).read_text(errors="replace").splitlines()

    def kill(self):
        """A hung launch, or the soak interrupted: every process of every launch."""
        for pid in sessions_processes({launch["pid"] for launch in self.launches}):
            os.kill(pid, signal.SIGKILL)


def sessions_processes(sids):
    """Pids of the processes whose session is one of `sids` (each launch leads its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) in sids and fields[0] not in ("Z", "X"):
                pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def fill_disk(path):
    """A file that takes every free byte of the filesystem at `path`."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (b"\0" * 2**20, b"\0" * 4096, b"\0"):  # big, then to the last page
            try:
                while True:
                    f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    return filler


def checkpoint_steps(ckpt_dir):
    return sorted(int(p.name[5:-3]) for p in ckpt_dir.glob("ckpt_*.pt") if p.name[5:-3].isdigit())


def inject(job, kind, rank, hold, runs):
    """One real fault; returns what was done to whom."""
    rank = rank if rank in job.workers else min(job.workers)
    if kind == "kill_rank":
        os.kill(job.workers[rank], signal.SIGKILL)
        return f"rank {rank} (pid {job.workers[rank]})"
    if kind == "stop_rank":
        os.kill(job.workers[rank], signal.SIGSTOP)
        time.sleep(hold)  # the peers' board names it after 10 s; torchrun then stops the group
        if alive(job.workers[rank]):
            os.kill(job.workers[rank], signal.SIGCONT)
        return f"rank {rank} (pid {job.workers[rank]}) for {hold:.0f} s"
    if kind in ("preempt", "kill_launcher"):
        job.proc.send_signal(signal.SIGTERM if kind == "preempt" else signal.SIGKILL)
        return f"torchrun (pid {job.proc.pid})"
    filler = fill_disk(runs)
    time.sleep(hold)
    filler.unlink()
    return f"runs/ ({TMPFS_SIZE} tmpfs) full for {hold:.0f} s"


def wait_for_recovery(job, fault, sps, ckpt_dir):
    """Block until the run is back past the step it had at the fault; fills fault's outcome."""
    t0, step0, starts0, saved0 = fault["t"], fault["step"], fault["starts"], fault["saved"]
    while time.time() - t0 < RECOVERY_LIMIT:
        relaunched = job.keep_running()
        if relaunched:
            last = job.launches[-2]
            codes = ",".join(str(c) for _, c in sorted(last["workers"].items()))
            fault["exits"].append(f"torchrun {last['code']} (ranks {codes or '-'})")
        if fault["kind"] == "full_disk":
            back = (checkpoint_steps(ckpt_dir) or [0])[-1] > max(saved0, fault["step_freed"])
        else:
            back = job.starts > starts0 and job.step > step0
        if back:
            job.poll()
            fault["notes"] = gist([line for t, line in job.notes if t >= t0])
            lost = time.time() - t0 - (job.step - step0) / sps
            fault.update(recovered=True, lost=max(lost, 0.0))
            return
        time.sleep(0.25)
    fault["notes"] = gist([line for t, line in job.notes if t >= t0])
    fault.update(recovered=False, lost=time.time() - t0)
    job.kill()  # hung: the next launch starts over from the newest checkpoint


def gist(lines):
    """The trainer's lines for a table cell: no pipes, and a line repeated with other numbers
    (a failed save per iteration on a full disk) once, with its count."""
    counts = {}
    for line in lines:
        line = line.split(", continue with:")[0].split("; environments start")[0]
        line = re.sub(r"runs/chaos/checkpoints/ckpt_0*(\d+)\.pt", r"ckpt \1", line)
        line = (line if len(line) <= 140 else line[:137] + "...").replace("|", "/")
        counts.setdefault(re.sub(r"\d+", "N", line), []).append(line)
    return [f"{same[0]} (x{len(same)})" if len(same) > 1 else same[0] for same in counts.values()]


def soak(job, rng, kinds, minutes, gap, sps, runs, at_least=0):
    """Faults until `minutes` have passed and `at_least` were injected; then a SIGTERM. Returns
    the faults, the start and the stop."""
    ckpt_dir, faults, deck = runs / RUN / "checkpoints", [], []
    start = time.time()
    job.launch()
    next_at = start + rng.uniform(*gap)
    while time.time() < start + 60 * minutes or len(faults) < at_least:
        job.keep_running()
        if time.time() >= next_at and job.ready:
            if not deck:  # every kind once, in a seeded order, before any comes again
                deck = rng.sample(kinds, len(kinds))
            kind, rank = deck.pop(), rng.randrange(RANKS)
            hold = rng.uniform(15, 25) if kind == "stop_rank" else rng.uniform(20, 40)
            saved = (checkpoint_steps(ckpt_dir) or [0])[-1]
            fault = dict(kind=kind, t=time.time(), step=job.step, starts=job.starts, saved=saved)
            fault.update(exits=[], target=inject(job, kind, rank, hold, runs))
            job.poll()  # the steps made while the fault held
            fault["step_freed"] = job.step if kind == "full_disk" else 0
            print(f"{fault['t'] - start:6.0f} s  {kind} {fault['target']}", flush=True)
            wait_for_recovery(job, fault, sps, ckpt_dir)
            faults.append(fault)
            next_at = time.time() + rng.uniform(*gap)
        time.sleep(0.25)
    stop = stop_run(job)
    return faults, start, stop


def stop_run(job):
    """SIGTERM to torchrun once the run trains (a scheduler's end of the job): it must save."""
    deadline = time.time() + RECOVERY_LIMIT
    while not job.ready and time.time() < deadline:
        job.keep_running()
        time.sleep(0.25)
    job.proc.send_signal(signal.SIGTERM)
    try:
        job.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        job.kill()
        job.proc.wait()
    job.poll()
    job.launches[-1].update(code=job.proc.returncode, workers=job.reap_workers())
    saved = [m for line in job.lines() if (m := PREEMPTED_LINE.match(line))]
    return {"t": time.time(), "saved": saved[-1][2] if saved else None}


def warmup_sps(cmd, workdir, seconds):
    """Fault-free steady SPS: a run of `seconds` after its first iteration, timed by the wall
    times of its charts/SPS events (the first 3 left out: their kernels are still being built)."""
    workdir.mkdir()
    job = Job(workdir, cmd)
    job.launch()
    try:
        while not job.ready and job.poll():
            time.sleep(0.5)
        time.sleep(seconds)
        job.proc.send_signal(signal.SIGTERM)
        job.proc.wait(timeout=120)
    finally:
        job.kill()  # nothing once it has stopped; all of it if the soak was interrupted
    events = sps_events(workdir / "runs" / RUN)[3:]
    return (events[-1].step - events[0].step) / (events[-1].wall_time - events[0].wall_time)


def sps_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # each purge is expected here

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()  # purge_step events drop what a start logged past the checkpoint it resumed
    return acc.Scalars("charts/SPS") if "charts/SPS" in acc.Tags()["scalars"] else []


def trainer_module():
    spec = importlib.util.spec_from_file_location("ppo_atari_multigpu", TRAINER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_checks(job, runs, stop, sps, seconds, faults, extra):
    """[(check, passed, detail)] from the run's own files, and the goodput's parts."""
    ppo, run_dir = trainer_module(), runs / RUN
    env_id = extra[extra.index("--env-id") + 1] if "--env-id" in extra else ppo.Args.env_id
    env = ppo.make_env(env_id, 0, False, "chaos", ppo.Args.frame_stack)()
    agent = ppo.Agent(env.observation_space.shape, env.action_space.n)
    ckpts, bad, final = sorted((run_dir / "checkpoints").glob("ckpt_*.pt*")), [], 0
    for path in ckpts:
        try:
            final = max(final, ppo.load_checkpoint(str(path), agent)["global_step"])
        except ValueError as e:
            bad.append(f"{path.name}: {e}")
    steps = [e.step for e in sps_events(run_dir)]
    want = list(range(BATCH, (steps or [0])[-1] + BATCH, BATCH))
    missing, twice = sorted(set(want) - set(steps)), len(steps) - len(set(steps))
    left = sessions_processes({launch["pid"] for launch in job.launches})
    with open(run_dir / "lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = False
        except BlockingIOError:
            locked = True
    goodput, last = final / (sps * seconds), (steps or [0])[-1]
    lost = [f for f in faults if not f["recovered"]]
    names = ", ".join(p.name for p in ckpts)
    return [
        ("the final SIGTERM saved and exited 75", bool(stop["saved"]), f"saved {stop['saved']}"),
        ("every checkpoint loads", bool(ckpts) and not bad, "; ".join(bad) or names),
        (
            "charts/SPS logged once per iteration",
            steps == want,
            f"{len(steps)} steps to {want[-1] if want else 0}: "
            f"{len(missing)} missing {missing[:5]}, {twice} twice",
        ),
        ("the final checkpoint is the last step logged", final == last, f"{final}, {last}"),
        ("no process or lock left", not left and not locked, f"processes {left}, lock {locked}"),
        ("every fault recovered", not lost, f"{len(faults) - len(lost)} of {len(faults)}"),
        (
            f"goodput >= {GOODPUT_BAR}",
            goodput >= GOODPUT_BAR,
            f"{goodput:.3f} = {final} steps / ({sps:.1f} SPS x {seconds:.0f} s)",
        ),
    ], goodput


def git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout


def machine():
    """The commit (and whether the checkout differs from it) and the CPU."""
    commit = git("rev-parse", "--short", "HEAD").strip()
    commit += " (with uncommitted changes)" if git("status", "--porcelain", "-uno").strip() else ""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu if "Model name" in ln), "?")
    return commit, f"{cpu}, {os.cpu_count()} cores"


def report(args, cmd, kinds, sps, sps_from, start, stop, faults, checks, goodput):
    commit, cpu = machine()
    out = [
        f"# Chaos soak, seed {args.seed}, {args.minutes:g} minutes",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- commit: {commit}",
        f"- command: `{shlex.join(['python', 'benchmark/chaos.py', *sys.argv[1:]])}`",
        f"- CPU: {cpu}",
        f"- trainer launch: `{shlex.join(cmd).replace(str(ROOT) + '/', '')}`",
        f"- fault kinds: {', '.join(kinds)}; a fault {args.gap[0]:g}-{args.gap[1]:g} s after the "
        "run recovered from the last",
        f"- fault-free SPS: {sps:.1f} ({sps_from}); soak: {stop['t'] - start:.0f} s, "
        f"{len(faults)} faults",
        "",
        "| time (s) | kind | target | outcome | recovered | seconds lost |",
        "|---:|---|---|---|---|---:|",
    ]
    for f in faults:
        exits = [f"exit: {e}" for e in f["exits"]]
        outcome = "<br>".join([f"at step {f['step']}", *f["notes"], *exits])
        ok = "yes" if f["recovered"] else "**no** (killed as hung)"
        out.append(
            f"| {f['t'] - start:.0f} | {f['kind']} | {f['target']} | {outcome} | {ok} "
            f"| {f['lost']:.1f} |"
        )
    out += ["", "| kind | injected | recovered | seconds lost |", "|---|---:|---:|---:|"]
    for kind in kinds:
        of = [f for f in faults if f["kind"] == kind]
        lost = sum(f["lost"] for f in of)
        out.append(f"| {kind} | {len(of)} | {sum(f['recovered'] for f in of)} | {lost:.0f} |")
    out += ["", "| check | result | detail |", "|---|---|---|"]
    for name, ok, detail in checks:
        out.append(f"| {name} | {'pass' if ok else '**FAIL**'} | {detail} |")
    out += [
        "",
        f"Goodput (final checkpointed step / (fault-free SPS x soak seconds)): {checks[-1][2]}.",
        "",
    ]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, required=True, help="soak duration")
    parser.add_argument("--seed", type=int, required=True, help="seeds the faults' draw")
    parser.add_argument("--out", type=Path, help="markdown report (default results/chaos-seedS)")
    parser.add_argument("--warmup-sps", type=float, help="skip the warm-up: this fault-free SPS")
    parser.add_argument("--warmup-seconds", type=float, default=60.0)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--gap", type=float, nargs=2, default=[30.0, 90.0], metavar=("LO", "HI"))
    parser.add_argument("--faults", type=int, default=0, help="at least this many, past M")
    parser.add_argument("extra", nargs="*", help="after --: more trainer flags")
    args = parser.parse_args()
    out = args.out or ROOT / f"benchmark/results/chaos-seed{args.seed}.md"
    cmd, rng = trainer_command(args.extra), random.Random(args.seed)
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: workers orphaned by torchrun's
    # death come to us, so their exit codes can be read and no zombie stays
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM cleans up too
    if args.warmup_sps:
        sps, sps_from = args.warmup_sps, "given by --warmup-sps"
    else:
        sps = warmup_sps(cmd, work / "warmup", args.warmup_seconds)
        sps_from = f"a {args.warmup_seconds:g} s warm-up of the same launch, events after the 3rd"
    runs, kinds = work / "soak" / "runs", list(args.kinds)
    runs.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(runs)]
    mounted = "full_disk" in kinds and subprocess.run(mount, capture_output=True).returncode == 0
    if "full_disk" in kinds and not mounted:
        kinds.remove("full_disk")  # not root: the other kinds still run
        print("no tmpfs could be mounted: the full-disk fault is left out", file=sys.stderr)
    job = Job(work / "soak", cmd)
    try:
        faults, start, stop = soak(job, rng, kinds, args.minutes, args.gap, sps, runs, args.faults)
    except BaseException:
        job.kill()
        if mounted:
            subprocess.run(["umount", "-l", str(runs)], capture_output=True)
        raise
    seconds = stop["t"] - start
    checks, goodput = run_checks(job, runs, stop, sps, seconds, faults, args.extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(args, cmd, kinds, sps, sps_from, start, stop, faults, checks, goodput))
    passed = all(ok for _, ok, _ in checks)
    if passed:
        if mounted:
            subprocess.run(["umount", str(runs)], check=True)
        shutil.rmtree(work)
    else:  # the evidence stays: its logs and, mounted, its run directory
        print(f"kept {work}" + (f" (umount {runs} when done)" if mounted else ""), file=sys.stderr)
    failed = [name for name, ok, _ in checks if not ok]
    print(
        f"chaos seed {args.seed}: {len(faults)} faults in {seconds:.0f} s, goodput {goodput:.3f}, "
        + ("all checks pass" if passed else f"FAILED: {', '.join(failed)}")
        + f"; report {out}"
    )
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
