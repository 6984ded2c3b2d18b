"""Two nodes joined by a slow link, on one machine (needs root and iproute2's ip and tc):
    python benchmark/slow_link.py [--links unshaped 10gbit 1gbit] [--modes overlap one]
        [--repeats 3] [--iterations 10] [--host HOST]
Makes two network namespaces joined by a veth pair, addresses in 198.18.0.0/30 (the range set
aside for network benchmarks) and no route out, so traffic goes only between them. Each end is
shaped with `tc qdisc replace dev D root tbf rate R burst 256kb latency 100ms` (none for
"unshaped"). One torchrun node per namespace (--nnodes=2, c10d rendezvous over the veth,
GLOO_SOCKET_IFNAME per side), one rank × 4 envs each, each node pinned to its own core.
Runs alternate (link × mode, then again), so slow drift hits every row alike. Writes a markdown
table (SPS after warm-up, × the unshaped link with the same mode, per-part seconds of rank 0,
the all-reduce's share) to stdout and to benchmark/results/slow-link-<host>.md; progress on
stderr. The namespaces are removed at the end, on an error and on Ctrl-C / SIGTERM."""

import argparse
import datetime
import os
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # noqa: E402
    NUM_STEPS,
    TRAINER,
    error_line,
    fmt_range,
    kill_tree,
    load_trainer,
    read_run,
)

ENVS = 4  # per node
ADDRS = ("198.18.0.1", "198.18.0.2")
MODES = {  # name -> (what the row says, the trainer's flags)
    "overlap": ("overlap (default: buckets during backward)", []),
    "one": ("one all-reduce after backward (--bucket-mb 0)", ["--bucket-mb", "0"]),
    "fp16": ("overlap + fp16 gradients (--allreduce-fp16)", ["--allreduce-fp16"]),
}


def missing(euid, which):
    """Why this machine cannot build the link (one line), or None."""
    if euid != 0:
        return "slow_link.py needs root (network namespaces and tc): run it as root"
    absent = [tool for tool in ("ip", "tc", "taskset") if which(tool) is None]
    if absent:
        return (
            f"slow_link.py needs iproute2's ip and tc, and taskset: not found: {' '.join(absent)}"
        )
    return None


def rate_bits(link):
    """'1gbit' -> 1e9, '10gbit' -> 1e10, 'unshaped' -> None."""
    if link == "unshaped":
        return None
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if link.endswith(unit) and link[: -len(unit)].replace(".", "", 1).isdigit():
            return float(link[: -len(unit)]) * scale
    raise argparse.ArgumentTypeError(f"a link is 'unshaped' or a rate like 1gbit, got {link!r}")


class Link:
    """The two namespaces and the veth between them; close() removes them (and the veth) and
    undoes a make() that failed half-way."""

    def __init__(self):
        tag = str(os.getpid())
        self.ns = (f"ppo-sl{tag}-a", f"ppo-sl{tag}-b")
        self.dev = (f"sla{tag}", f"slb{tag}")
        self.made = []

    def make(self):
        for ns in self.ns:
            self.ip("netns", "add", ns)
            self.made.append(ns)
        self.ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, ADDRS):
            self.ip("link", "set", dev, "netns", ns)
            self.ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            self.ip("-n", ns, "link", "set", dev, "up")
            self.ip("-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def ip(*args, tool="ip", check=True):
        out = subprocess.run([tool, *args], capture_output=True, text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"`{tool} {' '.join(args)}` failed: {out.stderr.strip()}")

    def shape(self, link):
        for ns, dev in zip(self.ns, self.dev):
            if link == "unshaped":
                self.ip("-n", ns, "qdisc", "del", "dev", dev, "root", tool="tc", check=False)
            else:
                tbf = f"tbf rate {link} burst 256kb latency 100ms".split()
                self.ip("-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf, tool="tc")

    def close(self):
        for ns in self.made:
            self.ip("netns", "del", ns, check=False)
        self.made = []


def run_pair(link, mode, rep, a, cores, tmp, port):
    """One two-node run over the link: read_run's answer, or {"error": ...}."""
    run_name = f"slow-{link}-{mode}-{rep}"
    procs = []
    for node in (0, 1):
        ns, dev = a.net.ns[node], a.net.dev[node]
        cmd = ["ip", "netns", "exec", ns, "taskset", "-c", str(cores[node]), sys.executable]
        cmd += ["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={ADDRS[0]}:{port}", f"--rdzv-id={port}"]
        cmd += ["--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", ADDRS[node]]
        cmd += [str(TRAINER), "--env-id", a.env_id, "--local-num-envs", str(ENVS), "--no-cuda"]
        cmd += ["--total-timesteps", str(a.iterations * 2 * ENVS * NUM_STEPS), "--threads", "1"]
        cmd += ["--eval-episodes", "0", "--save-interval", "0", "--run-name", run_name]
        cmd += MODES[mode][1]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=dev, PYTHONUNBUFFERED="1")
        procs.append(
            subprocess.Popen(
                cmd, cwd=tmp, env=env, text=True, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
        )  # fmt: skip
    a.running = procs
    errs, deadline = [], time.time() + a.timeout
    try:
        for p in procs:
            errs.append(p.communicate(timeout=max(1, deadline - time.time()))[1])
    except subprocess.TimeoutExpired:
        kill(procs)
        return {"error": f"timed out after {a.timeout:.0f} s"}
    finally:
        a.running = []
    try:
        if any(p.returncode for p in procs):
            return {"error": error_line("\n".join(errs))}
        return read_run(Path(tmp, "runs", run_name), 2 * ENVS * NUM_STEPS)
    except Exception as e:  # exited 0 but logged nothing usable
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(Path(tmp, "runs", run_name), ignore_errors=True)


def kill(procs):
    for p in procs:
        kill_tree(p.pid)  # torchrun starts its rank in a session of its own
        p.wait()


def report(a, results, started, cores, buffer_bytes):
    """The markdown table. results: {(link, mode): [read_run answers over repeats]}."""
    md = [
        f"# Two nodes over a slow link: ppo_atari_multigpu.py on {a.host}",
        "",
        f"- date: {started:%Y-%m-%d %H:%M %Z}, took {(time.time() - started.timestamp()) / 60:.1f}"
        f" min; {a.repeats} repeat(s), alternated; {a.iterations} iterations per run, the first 2"
        " skipped",
        f"- 2 nodes × 1 rank × {ENVS} envs (global batch {2 * ENVS * NUM_STEPS}), rank of node k"
        f" pinned to core {cores[0]} / {cores[1]}, `--threads 1`, env {a.env_id}, CPU, gloo",
        "- link: veth between two network namespaces, both ends `tc qdisc replace dev D root tbf"
        " rate R burst 256kb latency 100ms` (unshaped: no qdisc)",
        "- command: `python benchmark/slow_link.py "
        + " ".join(shlex.quote(x) for x in sys.argv[1:])
        + "`",
        "",
        f"| link | mode | SPS median | SPS min–max | × unshaped {a.modes[0]}¹ | env s² |"
        " inference s² | update compute s² | all-reduce s² | all-reduce share² |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for link in a.links:
        for mode in a.modes:
            runs = results.get((link, mode), [])
            ok = [r for r in runs if "sps" in r]
            if not ok:
                errors = "; ".join(r["error"] for r in runs if "error" in r) or "not run"
                md.append(f"| {link} | {MODES[mode][0]} | failed: {errors} | | | | | | | |")
                continue
            sps = [r["sps"] for r in ok]
            base = [r.get("sps") for r in results.get(("unshaped", a.modes[0]), [])]
            ratio = "–"
            if base and all(base) and len(base) == len(ok) == len(runs):
                per = [s / b for s, b in zip(sps, base)]
                ratio = f"{np.median(sps) / np.median(base):.2f} ({fmt_range(per, 2)})"
            parts = {k: np.concatenate([r["parts"][k][0] for r in ok]) for k in ok[0]["parts"]}
            med = {k: float(np.median(v)) for k, v in parts.items()}
            share = np.median(parts["allreduce"] / sum(parts.values())) if parts else np.nan
            cells = [f"{med.get(k, np.nan):.3f}" for k in ("env", "inference", "update")]
            md.append(
                f"| {link} | {MODES[mode][0]} | {np.median(sps):.0f} | {fmt_range(sps)} | {ratio}"
                f" | {' | '.join(cells)} | {med.get('allreduce', np.nan):.3f} | {share:.2f} |"
            )
    per_iter = 4 * 4  # update epochs × minibatches: all-reduces of the whole buffer per iteration
    md += [
        "",
        f"¹ SPS median / the SPS median of the unshaped link with the first mode ({a.modes[0]}),"
        " both from this invocation; in brackets the min–max of the per-repeat ratios.",
        "² Rank 0's median seconds per iteration (pooled over repeats): inference = rollout −"
        " env; update compute = update − all-reduce; all-reduce = the time waiting for"
        " collectives that backward did not hide; share = all-reduce / the four parts.",
        "",
        f"Wire floor: a ring all-reduce of 2 ranks sends each way the flat buffer's"
        f" {buffer_bytes / 1e6:.1f} MB, {per_iter} times an iteration: "
        + ", ".join(
            f"{link} {per_iter * buffer_bytes * 8 / rate_bits(link):.2f} s"
            for link in a.links
            if rate_bits(link)
        )
        + " of transfer per iteration, before any overlap.",
    ]
    return "\n".join(md) + "\n"


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--links", nargs="+", default=["unshaped", "10gbit", "1gbit"])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iterations", type=int, default=10, help="iterations per run (1,024 steps)")
    p.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
    p.add_argument("--host", default=socket.gethostname(), help="names the results file")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    a = p.parse_args()
    for link in a.links:
        try:
            rate_bits(link)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    why = missing(os.geteuid(), shutil.which)
    if why:
        sys.exit(why)
    usable = sorted(os.sched_getaffinity(0))
    cores = (usable[0], usable[1 % len(usable)])

    def stop(signum, frame):
        raise KeyboardInterrupt  # cleaned up below, as for Ctrl-C

    signal.signal(signal.SIGTERM, stop)
    a.running, results, started = [], {}, datetime.datetime.now().astimezone()
    tmp = tempfile.mkdtemp(prefix="ppo-slow-link-")
    mod = load_trainer()
    agent = mod.Agent((4, 84, 84), 4)  # Breakout's (the default --env-id) network
    buffer_bytes = 4 * (sum(p.numel() for p in agent.parameters()) + len(mod.LOSS_STATS))
    a.net = Link()
    try:
        a.net.make()
        port = 29500
        for rep in range(a.repeats):
            for link in a.links:
                a.net.shape(link)
                for mode in a.modes:
                    port += 1  # a fresh rendezvous port each run: no TIME_WAIT clashes
                    r = run_pair(link, mode, rep, a, cores, tmp, port)
                    results.setdefault((link, mode), []).append(r)
                    said = f"{r['sps']:.0f} SPS" if "sps" in r else r["error"]
                    print(f"repeat {rep + 1}: {link} {mode}: {said}", file=sys.stderr, flush=True)
    except RuntimeError as e:  # a namespace, veth or qdisc that could not be made
        sys.exit(f"slow_link.py: {e}")
    except KeyboardInterrupt:
        kill(a.running)
        print("interrupted: namespaces removed, partial table below", file=sys.stderr)
    finally:
        a.net.close()
        shutil.rmtree(tmp, ignore_errors=True)
    md = report(a, results, started, cores, buffer_bytes)
    print(md)
    out = Path(__file__).resolve().parent / "results" / f"slow-link-{a.host}.md"
    out.write_text(md)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
