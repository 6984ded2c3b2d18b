"""Launch checks: device and backend choice (a pure function of flags and launch layout), the
launch environment, run-time sizes that are not flags, and flag minimums."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import SCRIPT

import ppo_atari_multigpu as ppo

HOST = socket.gethostname()


def choose(num_gpus, world_size=1, local_world_size=1, rank=0, local_rank=None, **flags):
    local_rank = rank % local_world_size if local_rank is None else local_rank
    args = ppo.Args(**flags)
    return ppo.choose_device(args, rank, local_rank, world_size, local_world_size, num_gpus)


def test_no_gpu_or_no_cuda_flag_gives_cpu_and_gloo():
    assert choose(0, world_size=2, local_world_size=2, rank=1) == (torch.device("cpu"), "gloo")
    assert choose(4, cuda=False) == (torch.device("cpu"), "gloo")


def test_one_gpu_per_rank_gives_nccl_on_the_local_gpu():
    # 2 nodes x 2 ranks, 2 GPUs per node: global rank 3 is local rank 1 on the second node
    device, backend = choose(2, world_size=4, local_world_size=2, rank=3)
    assert (device, backend) == (torch.device("cuda", 1), "nccl")


def test_gpu_follows_local_rank_when_the_launcher_sets_no_local_world_size():
    # LOCAL_WORLD_SIZE absent (read as 1): the GPU must still be LOCAL_RANK's, not GPU 0 for all
    device, backend = choose(2, world_size=4, local_world_size=1, rank=3, local_rank=1)
    assert (device, backend) == (torch.device("cuda", 1), "nccl")


def test_more_ranks_than_gpus_on_a_node_falls_back_to_gloo_on_shared_gpus():
    device, backend = choose(2, world_size=4, local_world_size=4, rank=2)
    assert (device, backend) == (torch.device("cuda", 0), "gloo")
    device, backend = choose(2, world_size=4, local_world_size=4, rank=1, device_ids=[0, 0, 1, 1])
    assert (device, backend) == (torch.device("cuda", 0), "gloo")


@pytest.mark.parametrize(
    "num_gpus, world, flags, words",
    [
        (0, 2, dict(backend="nccl"), ["--backend nccl needs CUDA", "use --backend gloo"]),
        (4, 1, dict(backend="nccl", cuda=False), ["--backend nccl needs CUDA"]),
        (2, 4, dict(backend="nccl"), ["nccl refuses two ranks on one GPU", "4 ranks per node"]),
        (2, 2, dict(device_ids=[0]), ["--device-ids has 1 ids for world size 2"]),
        (2, 2, dict(device_ids=[0, 3]), ["--device-ids [0, 3]", "2 GPUs"]),
    ],
)
def test_impossible_device_choices_are_refused_naming_the_flags(num_gpus, world, flags, words):
    with pytest.raises(ValueError) as err:
        choose(num_gpus, world_size=world, local_world_size=world, **flags)
    for word in words:
        assert word in str(err.value)


def test_every_rank_reaches_the_same_backend():
    for num_gpus in (0, 1, 2, 4):
        verdicts = {choose(num_gpus, 4, 4, rank)[1] for rank in range(4)}
        assert len(verdicts) == 1, (num_gpus, verdicts)


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "2"}, ["WORLD_SIZE=2 is set but RANK is not", "torchrun"]),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, ["MPI launcher (OMPI_COMM_WORLD_SIZE=4)", "torchrun"]),
        ({"PMI_SIZE": "2"}, ["MPI launcher (PMI_SIZE=2)"]),
        ({"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, ["(SLURM_NTASKS=2)", "torchrun"]),
    ],
)
def test_launches_that_would_train_n_separate_copies_are_refused(env, words):
    with pytest.raises(ValueError) as err:
        ppo.check_launch(env)
    for word in words:
        assert word in str(err.value)


def test_plain_and_torchrun_launches_pass_the_launch_check():
    ppo.check_launch({})
    ppo.check_launch({"WORLD_SIZE": "1"})
    ppo.check_launch({"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2"})
    ppo.check_launch({"SLURM_NTASKS": "1"})  # one task: nothing runs twice
    ppo.check_launch({"SLURM_NTASKS": "4"})  # a batch script's own python (no srun step): one run
    ppo.check_launch({"RANK": "0", "WORLD_SIZE": "2", "SLURM_NTASKS": "2"})  # torchrun under srun


@pytest.mark.parametrize(
    "flags, words",
    [
        (dict(keep_checkpoints=0), ["--keep-checkpoints must be >= 1, got 0"]),
        (dict(save_interval=-1), ["--save-interval must be >= 0, got -1"]),
        (dict(save_minutes=-2.0), ["--save-minutes must be >= 0"]),
        (dict(eval_episodes=-1), ["--eval-episodes must be >= 0"]),
        (dict(threads=0), ["--threads must be >= 1"]),
        (dict(pg_timeout=0.0), ["--pg-timeout must be > 0"]),
        (dict(gamma=1.5), ["--gamma must be in [0, 1], got 1.5"]),
        (dict(gae_lambda=-0.1), ["--gae-lambda must be in [0, 1]"]),
        (dict(learning_rate=-1.0), ["--learning-rate must be > 0, got -1.0"]),
        (dict(clip_coef=0.0), ["--clip-coef must be > 0"]),
        (dict(vf_coef=float("nan")), ["--vf-coef must be > 0, got nan"]),
        (dict(max_grad_norm=float("inf")), ["--max-grad-norm must be > 0, got inf"]),
        (dict(target_kl=0.0), ["--target-kl must be > 0"]),
        (dict(ent_coef=-0.01), ["--ent-coef must be >= 0"]),
        (dict(print_every=-1.0), ["--print-every must be >= 0"]),
        (dict(seed=-1), ["--seed must be in [0, 2**31)"]),
        (dict(eval_checkpoint="m.model", eval_episodes=0), ["--eval-checkpoint needs"]),
    ],
)
def test_out_of_range_flags_are_refused_naming_the_flag(flags, words):
    with pytest.raises(ValueError) as err:
        ppo.check_args(ppo.Args(**flags), 1)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "flag", ["--batch-size", "--minibatch-size", "--num-iterations", "--world-size"]
)
def test_sizes_computed_at_run_time_are_not_flags(flag):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), flag, "8"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "Unrecognized options" in out.stderr and flag in out.stderr


@pytest.mark.parametrize("isa", ["AVX2", "avx512_core"])
def test_amp_bf16_warns_where_onednn_may_not_use_bf16_instructions(monkeypatch, isa):
    # the cap is a setting the code reads, so the verdict does not depend on this machine's CPU
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    line = ppo.slow_bf16_warning(ppo.Args(amp="bf16"), torch.device("cpu"))
    assert line.startswith("warning: --amp bf16") and f"ONEDNN_MAX_CPU_ISA={isa.upper()}" in line


def test_amp_bf16_warns_on_a_cpu_without_bf16_instructions(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert "emulated" in ppo.slow_bf16_warning(ppo.Args(amp="bf16"), torch.device("cpu"))


def test_no_bf16_warning_without_bf16_on_the_cpu_or_where_it_is_native(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    for amp in ("none", "fp16"):
        assert ppo.slow_bf16_warning(ppo.Args(amp=amp), torch.device("cpu")) is None
    assert ppo.slow_bf16_warning(ppo.Args(amp="bf16"), torch.device("cuda", 0)) is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")  # native bf16 on every count
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert ppo.slow_bf16_warning(ppo.Args(amp="bf16"), torch.device("cpu")) is None


def test_cuda_runs_give_torch_one_thread_and_the_cores_to_the_env_groups(monkeypatch):
    monkeypatch.setattr(ppo.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)

    def counts(device, local_world_size, **flags):  # thread_counts runs after the sizes resolve
        args = ppo.resolve_sizes(ppo.Args(**flags), local_world_size)
        return ppo.thread_counts(args, device, local_world_size)

    assert counts(cpu, 2) == (8, 8)  # CPU: shared, as before
    assert counts(cpu, 2, threads=3) == (3, 3)
    assert counts(cuda, 1, local_num_envs=32) == (1, 15)  # the cores torch's thread leaves
    assert counts(cuda, 2, local_num_envs=32, async_envs=True) == (1, 3)  # (8 - 1) // 2 groups
    assert counts(cuda, 16, threads=2) == (2, 1)  # at least one
    assert counts(cuda, 1) == (1, 8)  # at most one thread per env: 8 envs
    assert counts(cuda, 1, local_num_envs=4, async_envs=True) == (1, 2)  # 2 envs per group


def test_compile_without_a_compiler_and_cuda_graphs_without_a_gpu_are_refused(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ValueError, match="--compile needs a C\\+\\+ compiler: no-such-compiler"):
        ppo.check_args(ppo.Args(compile=True), 1)
    monkeypatch.delenv("CXX")
    with pytest.raises(ValueError, match="--cuda-graphs replays the compiled step on a GPU"):
        ppo.check_args(ppo.Args(compile=True, cuda_graphs=True, cuda=False), 1)


@pytest.mark.parametrize(
    "message, blamed",
    [
        ("NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage (run with NCCL_DEBUG=WARN)", False),
        ("CUDA error: an illegal memory access was encountered (NCCL watchdog)", False),
        ("NCCL error: remote process exited or there was a network error", True),
        ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41", True),
    ],
)
def test_only_a_peers_own_words_blame_a_peer(message, blamed, monkeypatch, capsys):
    # issue 41: any RuntimeError that mentioned NCCL was reported as a peer's failure
    monkeypatch.setattr(ppo.dist, "is_initialized", lambda: True)
    ppo.CrashReport(0, 600.0)(RuntimeError, RuntimeError(message), None)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error [rank 0]: RuntimeError: ")
    assert ("a collective failed: a peer rank died or stopped responding" in line) == blamed


def test_a_peer_in_another_pid_namespace_on_this_host_is_never_judged_by_its_pid():
    # issue 41: containers that share a host name (host network) were judged by a pid that means
    # nothing in this namespace: a live peer was "dead". A pid above Linux's limit exists nowhere.
    board = ppo.FailureBoard.__new__(ppo.FailureBoard)  # its state only, no watcher thread
    board.me, board.store_alive, board.stale_after = [HOST, os.getpid(), "pid:[1]"], True, 60.0
    board.seen = {1: ([HOST, 2**22 + 1, "pid:[2]", "rollout", 3, 7], time.time())}
    assert board.silent_peers() == {}
    board.seen[1][0][2] = "pid:[1]"  # the same namespace: that pid is gone
    assert "rank 1" in board.silent_peers()[1] and "died without a word" in board.silent_peers()[1]
