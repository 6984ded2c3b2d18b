"""Tests for the Atari env pipeline of ppo_atari_multigpu.py: make_env, EpisodicLife, FireReset,
env_seeds and check_env_id, on real ALE games (Breakout, SpaceInvaders) with seeded random play."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ppo_atari_multigpu as trainer  # noqa: E402  (also registers the ALE envs)

BREAKOUT = "BreakoutNoFrameskip-v4"
SAME_STEP = gym.vector.AutoresetMode.SAME_STEP
FRAME_STACK = trainer.Args.frame_stack  # the default: 4


def vector_env(env_id, num_envs, frame_stack=FRAME_STACK):
    """Vector env built exactly as the trainer builds its own."""
    return gym.vector.SyncVectorEnv(
        [trainer.make_env(env_id, i, False, "test", frame_stack) for i in range(num_envs)],
        autoreset_mode=SAME_STEP,
    )


def frames_all_identical(stack):
    return all(np.array_equal(stack[k], stack[0]) for k in range(1, len(stack)))


@pytest.fixture
def breakout_vec():
    envs = vector_env(BREAKOUT, 1)
    yield envs
    envs.close()


def test_observations_are_uint8_stacks_of_four_84x84_frames():
    envs = vector_env(BREAKOUT, 2)
    try:
        space = envs.single_observation_space
        assert space.shape == (4, 84, 84) and space.dtype == np.uint8
        obs, _ = envs.reset(seed=[1, 2])
        assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
        assert all(space.contains(o) for o in obs)
        rng = np.random.default_rng(0)
        for _ in range(3):
            obs, rewards, terminated, truncated, _ = envs.step(
                rng.integers(envs.single_action_space.n, size=2)
            )
            assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
            assert all(space.contains(o) for o in obs)
            assert rewards.shape == terminated.shape == truncated.shape == (2,)
        assert obs.max() > 0, "the frames are blank"
    finally:
        envs.close()


def test_frame_stack_sets_how_many_of_the_latest_frames_an_observation_holds():
    envs = [vector_env(BREAKOUT, 2, n) for n in (2, FRAME_STACK)]
    try:
        assert envs[0].single_observation_space.shape == (2, 84, 84)
        obs = [e.reset(seed=[1, 2])[0] for e in envs]
        rng = np.random.default_rng(0)
        for _ in range(20):
            action = rng.integers(envs[0].single_action_space.n, size=2)
            obs = [e.step(action)[0] for e in envs]
            assert obs[0].shape == (2, 2, 84, 84)
            np.testing.assert_array_equal(obs[0], obs[1][:, -2:])  # the same latest frames
    finally:
        for e in envs:
            e.close()


def test_life_loss_ends_learning_episode_without_resetting_the_game():
    env = trainer.make_env(BREAKOUT, 0, False, "test", FRAME_STACK)()
    try:
        ale = env.unwrapped.ale
        rng = np.random.default_rng(0)
        n_actions = env.action_space.n
        env.reset(seed=0)
        assert ale.lives() == 5

        lives_lost_without_reset = 0
        for _ in range(5000):
            lives_before = ale.lives()
            _, _, terminated, truncated, _ = env.step(int(rng.integers(n_actions)))
            assert not truncated
            if not terminated:
                # lives only ever drop on a step that ends the learning episode
                assert ale.lives() >= lives_before
                continue
            if ale.lives() == 0:  # real game over
                break
            # a life was lost: the learning episode ends on exactly that step
            assert ale.lives() == lives_before - 1
            frame_before, lives_at_loss = ale.getEpisodeFrameNumber(), ale.lives()
            env.reset()
            # ... but the game goes on: no new game, same lives, time keeps running
            assert ale.getEpisodeFrameNumber() > frame_before
            assert ale.lives() == lives_at_loss
            lives_lost_without_reset += 1
        else:
            pytest.fail("no game over within 5000 random steps")

        assert lives_lost_without_reset == 4, "every life but the last must end a learning episode"
        frame_at_game_over = ale.getEpisodeFrameNumber()
        env.reset()
        assert ale.lives() == 5, "a reset after game over starts a new game"
        # a new game: only the random no-ops (<= 30 frames) and FIRE steps (2 x 4 frames) have run
        assert ale.getEpisodeFrameNumber() <= 30 + 2 * 4 < frame_at_game_over
    finally:
        env.close()


def test_rewards_are_clipped_but_episode_return_is_the_unclipped_game_score():
    envs = vector_env("SpaceInvadersNoFrameskip-v4", 1)
    try:
        raw = []  # (reward, game ended) of every emulator frame, as the game itself produced them
        base = envs.envs[0].unwrapped
        orig_step = base.step

        def recording_step(action):
            result = orig_step(action)
            raw.append((float(result[1]), bool(result[2] or result[3])))
            return result

        base.step = recording_step
        envs.reset(seed=3)
        rng = np.random.default_rng(3)
        returned_rewards, episode = [], None
        for _ in range(3000):  # a random SpaceInvaders game lasts ~500-1000 agent steps
            n_raw = len(raw)
            _, rewards, terminated, truncated, infos = envs.step(
                rng.integers(envs.single_action_space.n, size=1)
            )
            assert len(raw) >= n_raw + 4, "the monkeypatched emulator step is not being called"
            returned_rewards.append(float(rewards[0]))
            final = infos.get("final_info", {})
            if "episode" in final and final["_episode"][0]:
                episode = final["episode"]
                break
        else:
            pytest.fail("no finished game within 3000 random steps")

        assert set(returned_rewards) <= {-1.0, 0.0, 1.0}, (
            "rewards seen by the learner must be clipped"
        )
        # sum the game's frames up to its end only: the autoreset after it already played the next
        # game's no-ops and FIRE steps through the same (patched) emulator
        game_end = next(i for i, (_, ended) in enumerate(raw) if ended)
        game_rewards = [r for r, _ in raw[: game_end + 1]]
        assert max(game_rewards) > 1, "SpaceInvaders gives raw rewards > 1; none were seen"
        assert float(episode["r"][0]) == pytest.approx(sum(game_rewards))
        assert float(episode["r"][0]) > sum(returned_rewards)
        # the logged length is the game's length in emulator frames
        assert int(episode["l"][0]) == game_end + 1
    finally:
        envs.close()


def test_same_step_autoreset_returns_the_next_episodes_first_observation(breakout_vec):
    envs = breakout_vec
    assert envs.autoreset_mode == SAME_STEP
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        obs, _, terminated, truncated, infos = envs.step(
            rng.integers(envs.single_action_space.n, size=1)
        )
        if terminated[0] or truncated[0]:
            break
    else:
        pytest.fail("no episode ended within 2000 random steps")

    assert "final_obs" in infos and infos["_final_obs"][0]
    final_obs = infos["final_obs"][0]
    assert final_obs.shape == obs[0].shape
    assert not np.array_equal(final_obs, obs[0]), "the returned obs must be the next episode's"
    assert frames_all_identical(obs[0]), "a reset refills the frame stack with the first frame"
    assert not frames_all_identical(final_obs), "the final obs is a stack of 4 successive frames"

    # the next step is a real transition of the new episode: it consumes the action, the frame stack
    # shifts by one new frame, and it is not a filler 'done' repeating the reset observation
    next_obs, _, terminated, truncated, _ = envs.step(np.array([0]))
    assert not (terminated[0] or truncated[0])
    assert not np.array_equal(next_obs[0], obs[0])
    np.testing.assert_array_equal(next_obs[0][:3], obs[0][1:])


def test_every_env_of_every_rank_gets_a_distinct_seed():
    seed, ranks, local_num_envs = 7, 4, 8
    per_rank = [trainer.env_seeds(seed, rank, local_num_envs) for rank in range(ranks)]
    assert all(len(s) == local_num_envs for s in per_rank)
    flat = [s for rank_seeds in per_rank for s in rank_seeds]
    assert len(set(flat)) == len(flat), "two envs share a seed"
    assert flat == list(range(seed, seed + ranks * local_num_envs)), "seeds are not contiguous"
    split = [5, 1, 8, 2]  # --rank-envs: uneven ranks still tile one contiguous range
    uneven = [trainer.env_seeds(seed, rank, n, split) for rank, n in enumerate(split)]
    assert [len(s) for s in uneven] == split
    assert [s for rank_seeds in uneven for s in rank_seeds] == list(range(seed, seed + 16))

    # the seeds actually change the games: 6 fresh envs (as in the trainer's first reset) start
    # after different numbers of random no-ops, and the same seed reproduces the same start
    seeds = per_rank[1][:6]
    envs = vector_env(BREAKOUT, len(seeds))
    try:
        obs, infos = envs.reset(seed=seeds)
        start_frames = list(infos["episode_frame_number"])
        assert len(set(start_frames)) > 1, f"all envs started at the same frame {start_frames}"
        assert len({o.tobytes() for o in obs}) > 1, "all envs started from the same observation"
    finally:
        envs.close()
    again = vector_env(BREAKOUT, 2)
    try:
        obs2, infos2 = again.reset(seed=seeds[:2])
        assert list(infos2["episode_frame_number"]) == start_frames[:2]
        np.testing.assert_array_equal(obs2, obs[:2])
    finally:
        again.close()


@pytest.mark.parametrize("env_id", ["ALE/Breakout-v5", BREAKOUT])
def test_v5_env_ids_skip_frames_exactly_once(env_id):
    env = trainer.make_env(env_id, 0, False, "test", FRAME_STACK)()
    try:
        assert env.unwrapped._frameskip == 1, "the emulator must not skip frames itself"
        env.reset(seed=0)
        ale = env.unwrapped.ale
        for action in (0, 1, 2, 3):
            before = ale.getEpisodeFrameNumber()
            _, _, terminated, truncated, _ = env.step(action)
            assert not (terminated or truncated)
            assert ale.getEpisodeFrameNumber() - before == 4, (
                "one agent step must be 4 emulator frames"
            )
    finally:
        env.close()


@pytest.mark.parametrize(
    "bad_id, suggestion",
    [
        ("BreakoutNoFrameskip-v5", "BreakoutNoFrameskip-v4"),
        ("BreakoutNoFrameskp-v4", "BreakoutNoFrameskip-v4"),
    ],
)
def test_unknown_env_id_names_it_and_suggests_a_close_match(bad_id, suggestion):
    assert bad_id not in gym.registry and suggestion in gym.registry
    with pytest.raises(ValueError) as err:
        trainer.check_env_id(bad_id)
    assert bad_id in str(err.value)
    assert f"did you mean {suggestion!r}" in str(err.value)

    with pytest.raises(ValueError, match="not an Atari") as err:
        trainer.check_env_id("CartPole-v1")
    assert "CartPole-v1" in str(err.value)
    # real Atari ids pass
    trainer.check_env_id(BREAKOUT)
    trainer.check_env_id("ALE/Breakout-v5")


def test_grayscale_screen_of_the_inner_env_leaves_every_observation_as_with_rgb(monkeypatch):
    # AtariPreprocessing reads its frames from the emulator itself; the screen ale-py's step
    # copies out at every raw frame is dropped, so the trainer asks for the cheaper grayscale one.
    fast = vector_env(BREAKOUT, 2)
    make = gym.make
    monkeypatch.setattr(gym, "make", lambda *a, **kw: make(*a, **{**kw, "obs_type": "rgb"}))
    rgb = vector_env(BREAKOUT, 2)
    try:
        assert fast.envs[0].unwrapped._obs_type == "grayscale"
        assert rgb.envs[0].unwrapped._obs_type == "rgb"
        np.testing.assert_array_equal(fast.reset(seed=[4, 5])[0], rgb.reset(seed=[4, 5])[0])
        rng, ends = np.random.default_rng(4), 0
        for _ in range(600):
            action = rng.integers(fast.single_action_space.n, size=2)
            a, b = fast.step(action), rgb.step(action)
            for x, y in zip(a[:4], b[:4]):  # obs, reward, terminated, truncated
                np.testing.assert_array_equal(x, y)
            for i in np.flatnonzero(a[4].get("_final_obs", [])):
                np.testing.assert_array_equal(a[4]["final_obs"][i], b[4]["final_obs"][i])
            ends += int((a[2] | a[3]).sum())
        assert ends > 0, "no episode ended: the resets were not compared"
    finally:
        fast.close()
        rgb.close()
