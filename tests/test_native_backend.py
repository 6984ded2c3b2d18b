"""--env-backend sync (gymnasium SyncVectorEnv) vs native (ale-py AtariVectorEnv): same rules."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from ale_py.vector_env import AtariVectorEnv

import ppo_atari_multigpu as ppo
from ppo_atari_multigpu import NativeVectorEnv

SAME_STEP = gym.vector.AutoresetMode.SAME_STEP
FRAME_STACK = ppo.Args.frame_stack  # the default: 4


def make_sync(env_id, n, frame_stack=FRAME_STACK):
    thunks = [ppo.make_env(env_id, i, False, "test", frame_stack) for i in range(n)]
    return gym.vector.SyncVectorEnv(thunks, autoreset_mode=SAME_STEP)


def make_native(env_id, n, frame_stack=FRAME_STACK):
    return NativeVectorEnv(env_id, n, 1, frame_stack)


BACKENDS = {"sync": make_sync, "native": make_native}


def games(infos):
    """(env, return, length) of every game that ended this step."""
    fi = infos.get("final_info", {})
    if "episode" not in fi:
        return []
    return [
        (int(i), float(fi["episode"]["r"][i]), int(fi["episode"]["l"][i]))
        for i in np.flatnonzero(fi["_episode"])
    ]


def test_backends_agree_on_spaces_dtypes_and_clipped_rewards():
    n, rng = 2, np.random.default_rng(0)
    sync, nat = (
        make_sync("SpaceInvadersNoFrameskip-v4", n),
        make_native("SpaceInvadersNoFrameskip-v4", n),
    )
    assert nat.single_observation_space == sync.single_observation_space
    assert (
        nat.single_action_space == sync.single_action_space and nat.num_envs == sync.num_envs == n
    )
    (so, _), (no, _) = sync.reset(seed=[0, 1]), nat.reset(seed=[0, 1])
    assert so.shape == no.shape == (n, 4, 84, 84) and so.dtype == no.dtype == np.uint8
    nonzero = {"sync": 0, "native": 0}
    for _ in range(300):
        a = rng.integers(0, nat.single_action_space.n, n)
        for name, out in (("sync", sync.step(a)), ("native", nat.step(a))):
            obs, r, term, trunc, infos = out
            assert obs.shape == (n, 4, 84, 84) and obs.dtype == np.uint8
            assert r.dtype == np.float64 and r.shape == (n,)  # gymnasium's SyncVectorEnv dtype
            assert set(np.unique(r)) <= {-1.0, 0.0, 1.0}
            assert term.dtype == trunc.dtype == np.bool_
            assert ("final_info" in infos) == ("final_obs" in infos) == bool((term | trunc).any())
            nonzero[name] += np.count_nonzero(r)
    assert min(nonzero.values()) > 0  # invaders score 5..30 points: clipping really happened
    sync.close(), nat.close()


@pytest.mark.parametrize("backend", ["native", "sync"])
def test_life_loss_terminates_without_episode_and_game_goes_on(backend):
    env = BACKENDS[backend]("BreakoutNoFrameskip-v4", 2)
    _, infos = env.reset(seed=[3, 4])
    rng, lost, ended = np.random.default_rng(0), 0, 0
    for _ in range(2000):
        lives, efn = infos["lives"], infos["episode_frame_number"]
        obs, _, term, trunc, infos = env.step(rng.integers(0, 4, 2))
        over = {i for i, _, _ in games(infos)}
        ended += len(over)
        for i in np.flatnonzero(term):
            if i in over:  # game over: the info already describes the new game
                assert infos["lives"][i] == 5
                continue
            lost += 1
            assert 0 < infos["lives"][i] == lives[i] - 1  # same game, one life less
            assert infos["episode_frame_number"][i] > efn[i]  # its frame counter was not reset
            assert (obs[i] == obs[i, 3:4]).all()  # the next learning episode starts a fresh stack
        for i in np.flatnonzero(~(term | trunc)):
            assert infos["lives"][i] == lives[i]
        if lost >= 6 and ended >= 1:
            break
    assert lost >= 6 and ended >= 1
    env.close()


def noop_life_losses(env, steps, first_action=0):
    """Life losses (game overs excluded) and games ended in `steps` steps of NOOP, after one
    step of `first_action`."""
    lost, ended = 0, 0
    for t in range(steps):
        _, _, term, _, infos = env.step(np.full(1, first_action if t == 0 else 0, np.int64))
        ended += len(games(infos))
        lost += int(term[0]) - len(games(infos))
    return lost, ended


def test_sync_backend_presses_fire_after_a_lost_life():
    """Breakout with NOOP only: the ball comes back after a lost life only if FIRE is pressed;
    the sync pipeline presses it inside the reset (FireReset), so the game reaches game over."""
    env = make_sync("BreakoutNoFrameskip-v4", 1)
    env.reset(seed=[9])
    lost, ended = noop_life_losses(env, 1000)
    assert ended >= 1 and lost >= 4  # 5 lives: 4 life losses, then game over
    env.close()


def test_native_backend_leaves_fire_after_a_lost_life_to_the_agent():
    """The native backend executes only the agent's actions: with NOOP only, the ball lost once
    never comes back; one FIRE from the agent relaunches it and the next life is lost."""
    env = make_native("BreakoutNoFrameskip-v4", 1)
    env.reset(seed=[9])  # ale-py presses FIRE at the game's start: the first ball is in play
    assert noop_life_losses(env, 1000) == (1, 0)  # after that only the first life is lost
    assert noop_life_losses(env, 1000, first_action=1) == (1, 0)  # FIRE: one more life lost
    env.close()


def test_native_game_return_is_unclipped_sum_over_all_lives():
    """Replay the agent's actions in independent raw AtariVectorEnvs (NextStep autoreset, no
    life-loss signal, unclipped rewards)."""
    n, seeds = 2, [11, 12]
    env = make_native("SpaceInvadersNoFrameskip-v4", n)
    env.reset(seed=seeds)
    rng, executed, got, lives_lost = np.random.default_rng(1), [[], []], [], 0
    while len({i for i, _, _ in got}) < n:
        a = rng.integers(0, env.single_action_space.n, n)
        for i in range(n):
            executed[i].append(a[i])
        _, _, term, _, infos = env.step(a)
        got += games(infos)
        lives_lost += (term & ~infos.get("final_info", {}).get("_episode", np.zeros(n, bool))).sum()
    ref, big = [], 0
    for i in range(n):
        raw = AtariVectorEnv(
            "space_invaders",
            1,
            num_threads=1,
            autoreset_mode="NextStep",
            reward_clipping=False,
            stack_num=1,
        )
        raw.reset(seed=np.array([seeds[i]]))
        ret = 0.0
        for a in executed[i]:
            _, r, term, trunc, info = raw.step(np.array([a]))
            ret, big = ret + r[0], big + (r[0] > 1)
            if term[0] or trunc[0]:
                ref.append((i, ret, int(info["episode_frame_number"][0])))
                ret = 0.0
                raw.step(np.array([0]))  # NextStep: this step only resets
        raw.close()
    assert big > 0 and lives_lost >= 2 * n  # rewards > 1, games over several lives
    assert sorted(got) == sorted(ref)
    env.close()


def test_sync_game_return_is_unclipped_sum_over_all_lives(monkeypatch):
    """Record every raw action the wrappers send (no-ops, FIRE, agent), replay them in a fresh
    raw env and count its unclipped rewards and frames per game."""
    make, logs = gym.make, []

    class Recorder(gym.Wrapper):
        def __init__(self, env):
            super().__init__(env)
            self.log = []
            logs.append(self.log)

        def reset(self, **kwargs):
            self.log.append(("reset", kwargs.get("seed")))
            return self.env.reset(**kwargs)

        def step(self, action):
            self.log.append(int(action))
            return self.env.step(action)

    monkeypatch.setattr(ppo.gym, "make", lambda *a, **k: Recorder(make(*a, **k)))
    n = 2
    env = make_sync("SpaceInvadersNoFrameskip-v4", n)
    env.reset(seed=[21, 22])
    rng, got = np.random.default_rng(2), []
    while len({i for i, _, _ in got}) < n:
        _, _, _, _, infos = env.step(rng.integers(0, env.single_action_space.n, n))
        got += games(infos)
    env.close()
    ref, big = [], 0
    for i, log in enumerate(logs):
        raw = make("SpaceInvadersNoFrameskip-v4")
        for entry in log:
            if isinstance(entry, tuple):
                raw.reset(seed=entry[1])
                ret, length = 0.0, 0
                continue
            _, r, term, trunc, _ = raw.step(entry)
            ret, length, big = ret + r, length + 1, big + (r > 1)
            if term or trunc:
                ref.append((i, ret, length))
        raw.close()
    assert big > 0
    assert sorted(got) == sorted(ref)


@pytest.mark.parametrize("backend", ["native", "sync"])
def test_same_step_game_over_returns_new_game_first_stack(backend):
    env = BACKENDS[backend]("BreakoutNoFrameskip-v4", 2)
    obs, _ = env.reset(seed=[5, 6])
    rng, checked = np.random.default_rng(3), 0
    for _ in range(2000):
        prev = obs
        obs, _, term, trunc, infos = env.step(rng.integers(0, 4, 2))
        for i, _, _ in games(infos):
            final = np.asarray(
                infos["final_obs"][i]
            )  # gymnasium: object array; native: (N,4,84,84)
            assert infos["_final_obs"][i] and infos["lives"][i] == 5
            assert (obs[i] == obs[i, 0]).all()  # the new game's first frame, 4 times
            assert (final[:3] == prev[i, 1:]).all()  # the old game's real last stack ...
            assert not (final[3] == obs[i, 0]).all()  # ... whose last frame is not the new game's
            checked += 1
        if checked >= 2:
            break
    assert checked >= 2
    env.close()


def test_native_truncation_gives_final_obs_and_episode():
    gym.register(
        "BreakoutShortNoFrameskip-v4",
        entry_point="ale_py.env:AtariEnv",
        kwargs={**gym.spec("BreakoutNoFrameskip-v4").kwargs, "max_num_frames_per_episode": 400},
    )
    env = make_native("BreakoutShortNoFrameskip-v4", 2)
    obs, _ = env.reset(seed=[7, 8])
    for _ in range(200):
        prev = obs
        obs, _, term, trunc, infos = env.step(np.zeros(2, np.int64))
        if trunc.any():
            break
    cut = np.flatnonzero(trunc & ~term)
    assert len(cut) and {i for i, _, _ in games(infos)} >= set(cut)
    assert all(400 <= length <= 400 + 31 for _, _, length in games(infos))  # + reset no-ops/FIRE
    final = infos["final_obs"][cut]  # what the trainer bootstraps from
    assert final.shape == (len(cut), 4, 84, 84) and final.dtype == np.uint8
    assert (final[:, :3] == prev[cut, 1:]).all() and (obs[cut] == obs[cut, :1]).all()
    env.close()


def test_frame_stack_gives_both_backends_the_same_space_and_a_sliding_window_of_frames():
    sync, nat = (
        make_sync("BreakoutNoFrameskip-v4", 2, 2),
        make_native("BreakoutNoFrameskip-v4", 2, 2),
    )
    assert nat.single_observation_space == sync.single_observation_space
    assert nat.single_observation_space.shape == (2, 84, 84)
    prev, _ = nat.reset(seed=[3, 4])
    assert prev.shape == (2, 2, 84, 84) and (prev[:, 0] == prev[:, 1]).all()  # a new game
    rng = np.random.default_rng(0)
    for _ in range(50):
        obs, _, term, trunc, _ = nat.step(rng.integers(0, 4, 2))
        assert obs.shape == (2, 2, 84, 84)
        going_on = ~(term | trunc)
        assert (obs[going_on, 0] == prev[going_on, 1]).all()  # the older frame moved down
        prev = obs
    sync.close(), nat.close()


@pytest.mark.parametrize("async_envs", [False, True])
def test_native_rollout_stores_the_executed_action_and_its_log_prob(async_envs):
    """Every stored (action, log-prob) is what the emulator executed, after lost lives too."""
    args = ppo.resolve_sizes(
        ppo.Args(
            env_id="BreakoutNoFrameskip-v4",
            local_num_envs=4,
            total_timesteps=512,
            env_backend="native",
            async_envs=async_envs,
        ),
        1,
    )
    envs = ppo.RankEnvs(args, "t", False)
    sent = []
    for env in envs.envs:
        send = env.env.send
        env.env.send = lambda a, send=send: (sent.append(np.array(a)), send(a))[1]
    torch.manual_seed(0)
    agent = ppo.Agent(envs.single_observation_space.shape, envs.single_action_space.n)
    policy = agent.get_action_and_value  # the rollout's step, as MAIN takes it
    obs, lives_lost = torch.as_tensor(envs.reset([0, 1, 2, 3])), 0
    with torch.no_grad():
        for _ in range(600):
            sent.clear()
            if async_envs:  # as MAIN: the policy acts for one group while the other steps
                out, env_out = envs.act_and_step(policy, obs)
            else:
                out = policy(obs)
                env_out = envs.step(out["action"].cpu().numpy())
            action, logprob = out["action"], out["logprob"]
            assert action.tolist() == np.concatenate(sent).tolist()  # stored = executed
            expected = agent.get_action_and_value(obs, action)["logprob"]
            # half batches (--async-envs) take other kernels: equal to rounding
            torch.testing.assert_close(logprob, expected, rtol=0, atol=1e-5)
            next_obs, _, term, _, infos = env_out
            lives_lost += int(term.sum()) - len(games(infos))
            obs = torch.as_tensor(next_obs)
            if lives_lost >= 4:
                break
    envs.close()
    assert lives_lost >= 4  # random play in Breakout loses lives: the case was exercised


@pytest.mark.parametrize("env_id", ["PongNoFrameskip-v4", "BreakoutNoFrameskip-v4", "ALE/Pong-v5"])
def test_both_backends_cut_a_game_at_the_same_frame(env_id, monkeypatch):
    # issue 43 said gymnasium allows 400,000 frames where the native backend cuts at 108,000: with
    # the pinned ale-py both read the env spec's cap (108,000), and gymnasium adds no TimeLimit
    env = gym.make(env_id)
    assert env.spec.max_episode_steps is None
    gymnasium_cap = env.unwrapped.ale.getInt("max_num_frames_per_episode")
    env.close()
    seen = {}
    monkeypatch.setattr(ppo, "AtariVectorEnv", lambda game, n, **kw: seen.update(kw) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        NativeVectorEnv(env_id, 1, 1, 4)
    assert seen["max_num_frames_per_episode"] == gymnasium_cap == 108000
