"""Real faults, not mocks (issue 35, items 1 and 4): a run directory on a full disk (a small tmpfs,
mounted for the test), a checkpoint that carries code, and `srun` without torchrun.

The disk tests need root (mount); they skip where mounting is not allowed. They synchronise on
the trainer's own output lines, never on sleeps: the trainer is paused (SIGSTOP) at a line while
the test fills or frees the disk, then continued (SIGCONT)."""

import contextlib
import errno
import glob
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import PG_TIMEOUT, SCRIPT, TINY, free_port, scalar_tags, torchrun, worker_pids

import ppo_atari_multigpu as ppo

# A checkpoint of the default network is 20,270,157 bytes (19.3 MiB): model, Adam moments, RNGs.
CKPT_MIB = 19.4
LIMIT = 300  # seconds: a hung trainer is killed, far beyond a run's ~10-20 s on a slow machine
REFUSED = "holds objects other than tensors: refused, nothing from it was run"
FINAL_SAVE_FAILED = 1  # exit code of a run whose final checkpoint could not be written


# ---- a small disk under runs/ ----
@pytest.fixture
def small_disk(tmp_path):
    """mount(size): a tmpfs of `size` (mount's syntax, e.g. 64m) at tmp_path/runs, where the
    trainer (cwd tmp_path) writes its runs; unmounted afterwards, lazily if still busy."""
    mounted = []

    def mount(size):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / "runs"
        path.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            pytest.skip("no mount command here")
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(disk, leave=0):
    """A filler file on `disk` that leaves `leave` bytes free (0: the disk is full)."""
    filler = disk / "filler"
    want, chunk = free_bytes(disk) - leave, b"\0" * 2**20
    with open(filler, "wb", buffering=0) as f:
        try:
            while want > 0:
                want -= f.write(chunk[: min(want, len(chunk))])
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return filler


@contextlib.contextmanager
def trainer(tmp_path, *flags, watch):
    """The trainer as one plain process in tmp_path: its `watch` stream ("stdout" or "stderr")
    is a pipe to read line by line, the other goes to tmp_path/<other>.log. Killed on leaving,
    or by a watchdog after LIMIT seconds (a blocked readline then sees the end of the stream)."""
    other = "stderr" if watch == "stdout" else "stdout"
    log = open(tmp_path / f"{other}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *TINY, *map(str, flags)],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        text=True,
        **{watch: subprocess.PIPE, other: log},
    )
    watchdog = threading.Timer(LIMIT, proc.kill)
    watchdog.start()
    try:
        yield proc
    finally:
        watchdog.cancel()
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait()
        log.close()


def read_until(stream, done, what, other_log):
    """Lines read from `stream` up to and including the first for which done(line) holds."""
    lines = [stream.readline()]
    while not done(lines[-1]):
        assert lines[-1], (
            f"the trainer ended before {what}:\n"
            + "".join(lines)[-3000:]
            + other_log.read_text()[-3000:]
        )
        lines.append(stream.readline())
    return lines


def test_a_failed_periodic_save_warns_in_one_line_leaves_no_partial_file_and_the_next_succeeds(
    tmp_path, small_disk
):
    runs = small_disk("64m")
    # room for one checkpoint, not two: the save at step 64 fits, the next ones do not
    filler = fill(runs, leave=int(1.55 * CKPT_MIB * 2**20))
    flags = ["--total-timesteps", 384, "--save-interval", 1, "--keep-checkpoints", 1]
    flags += ["--eval-episodes", 0, "--run-name", "r"]
    ckpts = runs / "r/checkpoints"
    with trainer(tmp_path, *flags, watch="stderr") as proc:
        lines = read_until(
            proc.stderr,
            lambda line: "warning: checkpoint at step 192 " in line,
            "its second failed save",
            tmp_path / "stdout.log",
        )
        proc.send_signal(signal.SIGSTOP)  # paused at the warning, an iteration before a save
        warnings = [x for x in lines if "was not saved" in x]
        assert len(warnings) == 2, "".join(lines)
        for step, line in zip((128, 192), warnings):  # one line per failed save, no traceback
            assert line.startswith(f"warning: checkpoint at step {step} ")
            assert "No space left on device" in line
        assert "Traceback" not in "".join(lines), "".join(lines)
        # no partial file left; the newest complete checkpoint loads
        assert sorted(os.listdir(ckpts)) == ["ckpt_000000000064.pt"]
        ckpt = torch.load(ckpts / "ckpt_000000000064.pt", weights_only=True)
        assert ckpt["global_step"] == 64
        filler.unlink()  # space comes back
        proc.send_signal(signal.SIGCONT)
        stderr = "".join(lines) + proc.stderr.read()
        code = proc.wait()
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    assert [x for x in stderr.splitlines() if "was not saved" in x] == [x[:-1] for x in warnings]
    assert sorted(os.listdir(ckpts)) == ["ckpt_000000000384.pt"]  # the next saves succeeded
    final = torch.load(ckpts / "ckpt_000000000384.pt", weights_only=True)
    assert (final["iteration"], final["global_step"]) == (6, 384)


@pytest.mark.parametrize(
    "save_interval, iterations", [(1, 6), (0, 10)], ids=["after-good-saves", "nothing-saved-yet"]
)
def test_a_final_save_on_a_full_disk_exits_1_with_one_line_naming_the_last_good_checkpoint(
    tmp_path, small_disk, save_interval, iterations
):
    runs = small_disk("64m")
    flags = ["--total-timesteps", 64 * iterations, "--save-interval", save_interval]
    flags += ["--keep-checkpoints", 1, "--eval-episodes", 0, "--run-name", "r"]
    ckpts = runs / "r/checkpoints"
    with trainer(tmp_path, *flags, watch="stdout") as proc:
        read_until(
            proc.stdout,
            lambda line: line.startswith(f"iter 2/{iterations} "),
            "iteration 2",
            tmp_path / "stderr.log",
        )
        proc.send_signal(signal.SIGSTOP)  # with --save-interval 1: step 64 is saved, 128 may be
        fill(runs)  # nothing fits any more: checkpoints, TensorBoard's events
        assert free_bytes(runs) == 0
        proc.send_signal(signal.SIGCONT)
        proc.stdout.read()
        code = proc.wait()
    stderr = (tmp_path / "stderr.log").read_text()
    assert code == FINAL_SAVE_FAILED, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]  # TensorBoard's failed writes neither
    errors = [x for x in stderr.splitlines() if x.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: "), stderr[-3000:]
    assert "No space left on device" in errors[0]
    left = sorted(os.listdir(ckpts))
    assert all(name.startswith("ckpt_") and name.endswith(".pt") for name in left), left
    if save_interval:
        (good,) = left  # --keep-checkpoints 1
        assert good in errors[0]
        assert torch.load(ckpts / good, weights_only=True)["global_step"] in (64, 128)
    else:
        assert left == [] and "no checkpoint" in errors[0]
        # the fault did reach TensorBoard: 8 iterations of events (~1.2 KB each) on a full disk
        steps = [step for step, _ in scalar_tags(runs / "r")["charts/SPS"]]
        assert max(steps) < 64 * iterations, steps


def test_tensorboard_events_written_on_a_full_disk_come_back_once_each_when_space_returns(
    tmp_path, small_disk
):
    runs = small_disk("64m")
    flags = ["--total-timesteps", 64 * 12, "--save-interval", 0, "--eval-episodes", 0]
    with trainer(tmp_path, *flags, "--run-name", "r", watch="stdout") as proc:
        read_until(proc.stdout, lambda x: x.startswith("iter 2/12 "), "iter 2", tmp_path / "e")
        proc.send_signal(signal.SIGSTOP)
        filler = fill(runs)  # nothing fits: ~1.2 KB of events per iteration fail within 4
        proc.send_signal(signal.SIGCONT)
        read_until(proc.stdout, lambda x: x.startswith("iter 8/12 "), "iter 8", tmp_path / "e")
        proc.send_signal(signal.SIGSTOP)
        filler.unlink()  # space comes back; the end of the run writes what waited
        proc.send_signal(signal.SIGCONT)
        stdout = proc.stdout.read()
        code = proc.wait()
    stderr = (tmp_path / "stderr.log").read_text()
    assert code == 0, stderr[-3000:]
    failed = [x for x in stderr.splitlines() if "TensorBoard events wait in memory" in x]
    assert len(failed) == 1 and "No space left on device" in failed[0], stderr[-3000:]
    assert "TensorBoard events written again" in stdout
    assert len(glob.glob(str(runs / "r/events.out.tfevents.*"))) == 2  # the failed file stays
    steps = [step for step, _ in scalar_tags(runs / "r")["charts/SPS"]]
    assert steps == [64 * i for i in range(1, 13)]  # every iteration once, none lost


def test_scalars_a_full_disk_keeps_from_tensorboard_ride_in_a_checkpoint_and_log_once_on_resume(
    tmp_path, small_disk, monkeypatch, capsys
):
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)  # EventWriter sets it
    events = small_disk("1m") / "r"  # the events' own disk fills; the checkpoints' does not
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    args = ppo.resolve_sizes(ppo.Args(total_timesteps=256, num_steps=32, local_num_envs=2), 1)

    def parts():
        agent = ppo.Agent((4, 84, 84), 4)
        return agent, torch.optim.Adam(agent.parameters()), torch.amp.GradScaler(enabled=False)

    def log(writer, step):  # ~3 KB a step: a full tmpfs refuses it within two pages
        for k in range(100):
            writer.add_scalar(f"perf/x{k}", k, step)
        writer.add_scalar("charts/SPS", step, step)
        writer.flush()

    writer, checkpointer = ppo.EventWriter(str(events), 0), ppo.Checkpointer(args, "r", 0, 1)
    checkpointer.unlogged = writer.kept  # as MAIN
    log(writer, 64)
    fill(events.parent)
    log(writer, 128)
    log(writer, 192)
    assert "TensorBoard events wait in memory: [Errno 28]" in capsys.readouterr().err
    path = checkpointer.maybe_save(3, 192, *parts(), now=True)  # then the process dies
    os.remove(events.parent / "filler")
    args.resume = path
    resumed = ppo.Checkpointer(args, "r", 0, 1)
    assert resumed.resume(*parts()) == 192
    writer = ppo.EventWriter(str(events), 192, resumed.unlogged)
    log(writer, 256)
    writer.close()
    assert [step for step, _ in scalar_tags(events)["charts/SPS"]] == [64, 128, 192, 256]
    assert len(scalar_tags(events)["perf/x7"]) == 4


# ---- a checkpoint that carries code ----
class RunsCode:
    """Unpickled, this runs a shell command: what a checkpoint from a stranger may carry."""

    def __init__(self, witness):
        self.witness = str(witness)

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
@pytest.mark.parametrize("flag", ["--resume", "--eval-checkpoint"])
def test_a_checkpoint_that_carries_code_is_refused_with_one_line_and_none_of_it_runs(
    run_trainer, tmp_path, flag, writer
):
    witness = tmp_path / "PWNED"
    ckpt = {"model": RunsCode(witness), "optimizer": {}, "global_step": 64}
    if writer == "torch.save":
        torch.save(ckpt, tmp_path / "evil.pt")
    else:
        (tmp_path / "evil.pt").write_bytes(pickle.dumps(ckpt))
    out = run_trainer(*TINY, "--total-timesteps", 64, "--eval-episodes", 1, flag, "evil.pt")
    assert not witness.exists()
    assert out.returncode == 2, out.stderr[-3000:]
    refusals = [x for x in out.stderr.splitlines() if REFUSED in x]
    assert len(refusals) == 1, out.stderr[-3000:]
    assert "evil.pt" in refusals[0] and "unreadable" not in refusals[0]
    # none of torch's advice or warnings (its advice: load with weights_only=False)
    others = [x for x in (out.stdout + out.stderr).splitlines() if x not in refusals]
    assert [x for x in others if "weights_only" in x or "pickle" in x.lower()] == []


def test_a_truncated_checkpoint_stays_unreadable_not_refused_as_code(run_trainer, tmp_path):
    torch.save({"actor.weight": torch.zeros(4, 512)}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    out = run_trainer("--no-cuda", "--eval-checkpoint", "cut.pt", "--eval-episodes", 1)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error")]
    assert "cut.pt is unreadable" in line and REFUSED not in line


# ---- srun without torchrun ----
def slurm_env(ntasks, procid):
    """The environment srun gives task `procid` of `ntasks` on one node without PMI: SLURM_*
    only, none of torchrun's variables."""
    torchrun = "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT".split()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_")) and k not in torchrun
    }
    env.update(PYTHONUNBUFFERED="1", SLURM_JOB_ID="4242", SLURM_STEP_ID="0")
    env.update(SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID=str(procid))
    env.update(SLURM_LOCALID=str(procid), SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks))
    env.update(SLURM_STEP_NUM_TASKS=str(ntasks))
    return env


def slurm_task(tmp_path, ntasks, procid):
    flags = [*TINY, "--total-timesteps", "64", "--eval-episodes", "0"]
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *flags],
        cwd=tmp_path,
        env=slurm_env(ntasks, procid),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_srun_of_two_tasks_without_torchrun_is_refused_on_each_naming_slurm_ntasks(tmp_path):
    tasks = [slurm_task(tmp_path, 2, procid) for procid in (0, 1)]
    try:
        outs = [task.communicate(timeout=LIMIT) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    for task, (stdout, stderr) in zip(tasks, outs):
        assert task.returncode == 2, stdout[-2000:] + stderr[-2000:]
        (line,) = [x for x in stderr.splitlines() if x.startswith("error")]
        assert line.startswith("error: ") and "SLURM_NTASKS" in line and "torchrun" in line
        assert "iter " not in stdout
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_srun_of_one_task_is_not_refused_and_trains(tmp_path):
    task = slurm_task(tmp_path, 1, 0)
    try:
        stdout, stderr = task.communicate(timeout=LIMIT)
    finally:
        task.kill()
    assert task.returncode == 0, stderr[-3000:]
    assert "SLURM_NTASKS" not in stderr and "iter 1/1 " in stdout


# ---- torchrun's workers: hung, killed, orphaned; nodes without a shared disk ----
# Each test launches torchrun itself and reads its workers' output as it comes (Stream): it waits
# on the trainer's own lines, or on the end of a stream once every writer is gone.
HOST = socket.gethostname()
FLAGS = [*TINY, "--threads", "1", "--eval-episodes", "0"]
BATCH = 128  # steps per iteration of 2 ranks with TINY: 2 envs x 32 steps each
STORE_WARNING = ("TCPStore", "sendBytes")
LAUNCH = "TEST_FAULTS_LAUNCH"  # marks the processes of one Launch, for the cleanup


class Stream:
    """A process's stdout or stderr, read by a thread line by line: a test waits for a line, or
    for the end of the stream (every process that holds it gone), with a timeout."""

    def __init__(self, stream):
        self.lines, self.queue = [], queue.Queue()
        threading.Thread(target=self.read, args=(stream,), daemon=True).start()

    def read(self, stream):
        with stream:
            for line in stream:
                self.queue.put(line)
        self.queue.put(None)

    @property
    def text(self):
        return "".join(self.lines)

    def next(self, deadline, what):
        try:
            line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {what} in time:\n{self.text[-3000:]}") from None
        if line is not None:
            self.lines.append(line)
        return line

    def wait_for(self, done, what, timeout=LIMIT):
        """The first line from now on for which done(line) holds."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next(deadline, what)
            assert line is not None, f"the stream ended before {what}:\n{self.text[-3000:]}"
            if done(line):
                return line

    def until_end(self, what, timeout=LIMIT):
        deadline = time.monotonic() + timeout
        while self.next(deadline, what) is not None:
            pass
        self.queue.put(None)  # a second call ends at once too
        return self.text


def marked(tag):
    """The pids of the processes whose environment holds LAUNCH=tag: a Launch's agent and its
    workers (each in a session of its own, orphans too), whoever their parent is now."""
    found, mark = [], f"{LAUNCH}={tag}".encode()
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            if mark in open(environ, "rb").read().split(b"\0"):
                found.append(int(environ.split("/")[2]))
        except (OSError, ValueError):
            pass
    return found


def gone(pid):
    return ppo.proc_state(pid) in (None, "Z", "X")


class Launch:
    """One torchrun agent, started in `cwd` in a session of its own, its stdout and stderr read
    as Streams. Leaving the `with` ends it and its workers (marked by a LAUNCH tag in their
    environment), by pid: SIGCONT first, for a stopped one, then SIGKILL."""

    def __init__(self, cmd, cwd):
        self.tag = f"{os.getpid()}-{time.monotonic_ns()}"
        self.proc = subprocess.Popen(
            [*map(str, cmd)],
            cwd=cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **{LAUNCH: self.tag}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.out, self.err = Stream(self.proc.stdout), Stream(self.proc.stderr)

    def workers(self, *ranks):
        """{rank: pid} of this agent's workers, which must be `ranks`."""
        found = worker_pids(self.proc.pid)
        assert sorted(found) == sorted(ranks), (found, self.err.text[-3000:])
        return found

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        left = marked(self.tag)
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        self.proc.wait()


def test_a_hung_rank_is_named_with_its_host_pid_and_phase_and_the_run_ends_before_the_timeout(
    tmp_path,
):
    flags = [*FLAGS, "--total-timesteps", 10**7, "--save-interval", 0, "--pg-timeout", 60]
    with Launch([*torchrun(3), *flags], tmp_path) as run:
        run.out.wait_for(lambda line: line.startswith("iter 2/"), "iteration 2")
        workers = run.workers(0, 1, 2)
        hung = workers[2]
        os.kill(hung, signal.SIGSTOP)
        stopped = time.monotonic()
        run.err.wait_for(lambda line: "stopped answering" in line, "the hung rank's name")
        named_after = time.monotonic() - stopped
        deadline = stopped + LIMIT
        while not (gone(workers[0]) and gone(workers[1])):  # the healthy ranks' own exits
            assert time.monotonic() < deadline, "a healthy rank did not exit"
            time.sleep(0.1)
        ended_after = time.monotonic() - stopped
        # what torchrun does after its fixed 30 s grace for a rank that cannot take its SIGTERM
        # (--shutdown-timeout covers only torchrun's own signals in torch 2.13)
        os.kill(hung, signal.SIGKILL)
        code = run.proc.wait(timeout=LIMIT)
        stderr = run.err.until_end("the end of stderr")
        stdout = run.out.until_end("the end of stdout")
    assert code != 0
    named = f"rank 2 ({HOST}, pid {hung}) stopped answering "
    errors = [x for x in stderr.splitlines() if x.startswith("error [rank") and named in x]
    first = [x for x in errors if "stopping" not in x]
    assert len(first) == 1, stderr[-3000:]
    # where it was last seen: ranks publish once a second, so a tiny run's record may still say
    # setup, or an earlier iteration than the one it stopped in, never a later one
    pattern = (
        r"error \[rank ([01])\]: rank 2 \(([^,]+), pid (\d+)\) stopped answering \d+ s ago, "
        r"in (setup|the (rollout|update|report|save) of iteration (\d+))"
    )
    match = re.fullmatch(pattern, first[0])
    assert match and match[2] == HOST and int(match[3]) == hung, first[0]
    printed = [int(x.split("/")[0][5:]) for x in stdout.splitlines() if x.startswith("iter ")]
    assert match[6] is None or 1 <= int(match[6]) <= max(printed) + 1, first[0]
    reporter, other = int(match[1]), 1 - int(match[1])
    stopping = f"error [rank {other}]: stopping, rank {reporter}: {named}"
    assert any(x.startswith(stopping) for x in errors), stderr[-3000:]
    # named after ~12 s (a stopped process on this host: 10 s, in two watcher rounds), and the
    # healthy ranks gone within a second or two of it, where --pg-timeout is 60 s
    assert named_after < 30, f"named {named_after:.0f} s after the stop"
    assert ended_after < 60, f"the healthy ranks ended {ended_after:.0f} s after the stop"


def test_a_rank_killed_by_a_signal_is_named_by_its_peer_with_the_oom_killer_as_the_usual_cause(
    tmp_path,
):
    flags = [*FLAGS, "--total-timesteps", 10**7, "--save-interval", 0, "--pg-timeout", PG_TIMEOUT]
    with Launch([*torchrun(2), *flags], tmp_path) as run:
        run.out.wait_for(lambda line: line.startswith("iter 2/"), "iteration 2")
        killed = run.workers(0, 1)[1]
        os.kill(killed, signal.SIGKILL)
        stopped = time.monotonic()
        code = run.proc.wait(timeout=LIMIT)
        ended_after = time.monotonic() - stopped
        stderr = run.err.until_end("the end of stderr")
    assert code != 0
    named = f"rank 1 ({HOST}, pid {killed}) died without a word "
    lines = [x for x in stderr.splitlines() if x.startswith("error [rank 0]: ") and named in x]
    assert len(lines) == 1, stderr[-3000:]
    assert "killed by a signal" in lines[0] and "OOM killer" in lines[0]
    assert ended_after < 30, f"ended {ended_after:.0f} s after the kill"


# A run too long to finish: its launcher (torchrun's agent) is killed after iteration 3.
ORPHANED = [*FLAGS, "--total-timesteps", 200 * BATCH, "--save-interval", 1000, "--resume", "auto"]
ORPHANED += ["--run-name", "r"]
SAVED = r"saved (runs/r/checkpoints/ckpt_(\d+)\.pt); exit 75, continue with: torchrun \.\.\. "


def orphan_the_workers(tmp_path, sig):
    """Launch ORPHANED on 2 ranks and kill the agent with `sig` after iteration 3; check that
    both workers, orphans then, stop after one checkpoint with few store warnings. Returns the
    checkpoint's global step."""
    with Launch([*torchrun(2), *ORPHANED], tmp_path) as run:
        run.out.wait_for(lambda line: line.startswith("iter 3/"), "iteration 3")
        workers = run.workers(0, 1)
        os.kill(run.proc.pid, sig)
        assert run.proc.wait(timeout=LIMIT) == -sig  # the agent died of it: nothing forwarded
        # the orphans still hold the pipes: the end of both streams is their exit
        stdout = run.out.until_end("the workers' exit", timeout=60)
        stderr = run.err.until_end("the workers' exit", timeout=60)
        left = [pid for pid in workers.values() if not gone(pid)]
    assert left == [], stdout[-2000:] + stderr[-2000:]
    stops = [x for x in stdout.splitlines() if x.startswith("preempted (")]
    assert len(stops) == 1, stdout[-2000:] + stderr[-2000:]
    # every rank is orphaned; those whose watcher saw it before this iteration's report are named
    assert re.match(r"preempted \(rank [01]: launcher gone(, rank 1: launcher gone)?\)", stops[0])
    saved = re.search(SAVED, stops[0])
    assert saved and (tmp_path / saved[1]).is_file(), stops[0]
    assert stops[0].endswith(f"{SCRIPT} {' '.join(map(str, ORPHANED))}")
    # the store went with the launcher: a warning or two, not one per watcher round
    warnings = [x for x in stderr.splitlines() if any(w in x for w in STORE_WARNING)]
    assert len(warnings) < 10, "\n".join(warnings[:20])
    assert "error [rank" not in stderr, stderr[-3000:]
    return int(saved[2])


def test_a_launcher_killed_by_sigkill_stops_its_workers_with_a_checkpoint_the_same_command_resumes(
    tmp_path,
):
    step = orphan_the_workers(tmp_path, signal.SIGKILL)
    # the run's lock went with its holder: the same command continues it, from that step
    iteration = step // BATCH + 1
    with Launch([*torchrun(2), *ORPHANED], tmp_path) as run:
        resumed = run.out.wait_for(
            lambda line: line.startswith(("resumed", "iter ")), "the resume line"
        )
        first = run.out.wait_for(lambda line: line.startswith("iter "), "the first iteration")
        os.kill(run.proc.pid, signal.SIGTERM)  # a scheduler's preemption, to the launcher
        run.proc.wait(timeout=LIMIT)
        stdout = run.out.until_end("the workers' exit")
        stderr = run.err.until_end("the workers' exit")
    ckpt = f"runs/r/checkpoints/ckpt_{step:012d}.pt"
    assert resumed.startswith(f"resumed {ckpt}: iteration {iteration}, global step {step};"), (
        resumed + stderr[-3000:]
    )
    assert first.startswith(f"iter {iteration}/200 | step {step + BATCH} |"), first
    (stop,) = [x for x in stdout.splitlines() if x.startswith("preempted (")]
    assert stop.startswith("preempted (rank 0: SIGTERM, rank 1: SIGTERM): saved "), stop
    assert re.search(SAVED, stop), stop
    # each iteration logged once: the first launch's up to its checkpoint, then the second's
    steps = [s for s, _ in scalar_tags(tmp_path / "runs/r")["charts/SPS"]]
    assert steps == list(range(BATCH, steps[-1] + 1, BATCH)), steps
    assert steps[-1] >= step + BATCH  # the resumed launch's first iteration, at least


def test_a_launcher_killed_by_sigusr1_unforwarded_stops_its_workers_with_a_checkpoint(
    tmp_path,
):
    orphan_the_workers(tmp_path, signal.SIGUSR1)


def node(node_rank, port, cwd, flags):
    """torchrun's agent for node `node_rank` of 2, one rank each, on loopback (static
    rendezvous: node k runs rank k), started in `cwd`: its own runs/, as on a node without a
    shared disk."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
    cmd += [f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}"]
    return Launch([*cmd, SCRIPT, *flags], cwd)


def preempt(nodes):
    """SIGTERM to every agent, as a scheduler does; their stdouts once all have exited."""
    for launch in nodes:
        os.kill(launch.proc.pid, signal.SIGTERM)
    for launch in nodes:
        launch.proc.wait(timeout=LIMIT)
        launch.err.until_end("the workers' exit")
    return [launch.out.until_end("the workers' exit") for launch in nodes]


def test_without_a_shared_disk_a_resume_continues_from_the_node_that_holds_the_checkpoint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    flags = [*FLAGS, "--total-timesteps", 20 * BATCH, "--save-interval", 1, "--resume", "auto"]
    flags += ["--run-name", "r"]
    port = free_port()
    with node(0, port, a, flags) as first, node(1, port, b, flags) as second:
        # iteration 1's checkpoint is written before iteration 2 starts
        first.out.wait_for(lambda line: line.startswith("iter 2/"), "iteration 2")
        first.workers(0)
        second.workers(1)
        stdout, _ = preempt([first, second])
    assert "preempted (rank 0: SIGTERM" in stdout, stdout[-2000:] + first.err.text[-2000:]
    saved = ppo.checkpoint_files(str(a / "runs/r/checkpoints"))[-1]
    assert saved is not None and glob.glob(str(b / "runs/r/checkpoints/*")) == []
    step = torch.load(saved, weights_only=True)["global_step"]
    iteration = step // BATCH + 1

    port = free_port()  # the nodes swap: rank 0 now runs where there is no checkpoint
    with node(0, port, b, flags) as first, node(1, port, a, flags) as second:
        resumed = first.out.wait_for(
            lambda line: line.startswith(("resumed", "iter ")), "the resume line"
        )
        progress = first.out.wait_for(lambda line: line.startswith("iter "), "an iteration")
        first.workers(0)
        second.workers(1)
        stdout, _ = preempt([first, second])
    where = f"(on {HOST}, rank 1's node)"
    assert resumed.startswith(
        f"resumed runs/r/checkpoints/ckpt_{step:012d}.pt {where}: iteration {iteration}, "
        f"global step {step};"
    ), resumed + first.err.text[-3000:]
    assert progress.startswith(f"iter {iteration}/20 | step {step + BATCH} |"), progress
    assert "iter 1/" not in stdout  # never a silent fresh start


# ---- a run directory on a filesystem without locks ----
# Not a real fault: a filesystem whose flock fails with ENOLCK (NFS without lockd, some FUSE
# mounts) cannot be mounted here without a server or a module this machine lacks, so flock is
# replaced. What is tested is the trainer's answer to the errno the kernel gives there.
def refuse_flock(errno_, text):
    def flock(*args):
        raise OSError(errno_, text)

    return flock


def test_a_run_directory_without_locks_is_named_in_one_warning_line_and_the_run_goes_on(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ppo, "WHERE", dict(ppo.WHERE))  # fail() would mark this process leaving
    monkeypatch.setattr(ppo.fcntl, "flock", refuse_flock(errno.ENOLCK, "No locks available"))
    checkpointer = ppo.Checkpointer(ppo.Args(run_name="r"), "r", 0, 1)
    checkpointer.lock_run_dir()  # returns: no SystemExit
    checkpointer.lock.close()
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.startswith("warning: runs/r/lock is on a filesystem without locks"), line
    assert out == ""
    assert (tmp_path / "runs/r/checkpoints").is_dir()


def test_a_run_directory_refused_for_permissions_still_stops_the_run_with_exit_2(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ppo, "WHERE", dict(ppo.WHERE))
    monkeypatch.setattr(ppo.fcntl, "flock", refuse_flock(errno.EACCES, "Permission denied"))
    with pytest.raises(SystemExit) as stop:
        ppo.Checkpointer(ppo.Args(run_name="r"), "r", 0, 1).lock_run_dir()
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "error: cannot write the run directory runs/r: [Errno 13] Permission denied"
    assert "without locks" not in line
