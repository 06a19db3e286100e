"""``BatchVectorEnv``: batchrl's layout as a Gymnasium ``VectorEnv``.

It must return exactly what ``SyncVectorEnv`` returns for the same seeds and
actions (observations, rewards, flags, and the infos as Gymnasium's dict of
arrays), in both autoreset modes, and keep batchrl's error handling. The same
check runs on every transport in ``test_protocol.py``.
"""

from __future__ import annotations

import functools
from contextlib import closing
import sys

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from batchrl.envs import BatchVectorEnv, EnvError, EnvRaisedError, EnvTimeoutError, make_vec
from batchrl.envs.errors import EnvSpecError, SpaceMismatchError
from batchrl.envs.infos import InfoList, info_columns
from batchrl.testing.faults import FaultyEnv
from helpers import assert_same_value, assert_same_vector_steps

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


def make(env_id: str, limit: int, **kwargs):
    return functools.partial(gym.make, env_id, max_episode_steps=limit, **kwargs)


class InfoEnv(gym.Env):
    """Infos that vary by env and step: keys some envs lack, numpy bools,
    arrays, strings and nested dicts (Gymnasium's slow path), and a step
    where every env has the same number keys (the fast one)."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, index: int):
        self.index = index
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.normal(size=2), {"start": self.index, "options": options}

    def step(self, action):
        self.t += 1
        info = {"t": self.t, "value": float(action)}
        if self.t % 3 == 0:
            info.update(flag=np.bool_(self.index % 2), vector=np.full(2, self.index, np.float32),
                        name=f"env{self.index}", nested={"deep": self.index * 1.5})
        if self.index == 1 and self.t % 2:
            info["only_one"] = np.int32(self.t)
        done = self.t >= 4 + self.index
        return self.np_random.normal(size=2), float(action), done, False, info


def info_envs(count: int) -> list:
    return [functools.partial(InfoEnv, index) for index in range(count)]


@pytest.mark.parametrize("mode", MODES, ids=["next_step", "same_step"])
@pytest.mark.parametrize("env_id, limit, seed", [("CartPole-v1", 30, 0), ("CartPole-v1", 12, 5),
                                                 ("Pendulum-v1", 15, 3)])
def test_steps_as_sync_vector_env(mode, env_id, limit, seed):
    fns = [make(env_id, limit)] * 5
    with BatchVectorEnv(fns, mode, workers=2) as env, \
            closing(SyncVectorEnv(fns, autoreset_mode=mode)) as reference:
        assert_same_vector_steps(env, reference, seed=seed, steps=150)


@pytest.mark.parametrize("mode", MODES, ids=["next_step", "same_step"])
def test_infos_are_gymnasiums_dict_of_arrays(mode):
    fns = [make("HalfCheetah-v5", 8)] * 4
    with BatchVectorEnv(fns, mode, workers=2) as env, \
            closing(SyncVectorEnv(fns, autoreset_mode=mode)) as reference:
        assert_same_vector_steps(env, reference, seed=1, steps=20)
        env.reset(seed=1)
        for _ in range(8):
            *_, truncated, infos = env.step(np.zeros((4, 6), np.float32))
    assert truncated.all()
    assert infos["x_position"].shape == (4,) and infos["x_position"].dtype == np.float64
    assert infos["_x_position"].dtype == np.bool_
    if mode is AutoresetMode.SAME_STEP:
        assert infos["_final_obs"].all() and infos["final_obs"].dtype == object
        assert infos["final_obs"][0].shape == (17,)
        assert infos["final_info"]["reward_ctrl"].shape == (4,)
        # The step's infos moved to final_info; the reset's are there.
        assert "x_velocity" not in infos and infos["_x_position"].all()
    else:
        assert infos["_x_velocity"].all()


@pytest.mark.parametrize("mode", MODES, ids=["next_step", "same_step"])
@pytest.mark.parametrize("backend", ["workers", "inline"])
def test_uneven_infos_as_sync_vector_env(mode, backend):
    with BatchVectorEnv(info_envs(4), mode, backend=backend, workers=2) as env, \
            closing(SyncVectorEnv(info_envs(4), autoreset_mode=mode)) as reference:
        assert_same_vector_steps(env, reference, seed=2, steps=30)


def test_info_columns_keep_the_types_of_the_values():
    infos = [{"a": 1, "b": 2.5, "c": True, "d": np.float32(0.5), "e": np.int64(3)},
             {"a": 2, "b": -1.0, "c": False, "d": np.float32(1.5), "e": np.int64(-4)}]
    columns = info_columns(infos)
    assert columns is not None
    restored = list(InfoList([(2, columns)]))
    assert restored == infos
    assert [[type(v) for v in info.values()] for info in restored] == \
        [[type(v) for v in info.values()] for info in infos]
    stacked = InfoList([(1, info_columns(infos[:1])), (1, info_columns(infos[1:]))]).columns()
    assert stacked["b"].tolist() == [2.5, -1.0] and stacked["d"].dtype == np.float32
    # Mixed types, other keys or non-numbers: the dicts travel as they are.
    assert info_columns([{"a": 1}, {"a": 1.0}]) is None
    assert info_columns([{"a": 1}, {"b": 1}]) is None
    assert info_columns([{"a": np.bool_(True)}]) is None
    assert info_columns([{"a": 2 ** 70}]) is None


class TypedInfoEnv(gym.Env):
    """An info value of one key that is an int in envs 0 and 1 and a float in the others: each
    worker of two sends its own envs' infos as a record array, of a field type the other's
    does not share."""

    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, index: int):
        self.index = index

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        value = self.index if self.index < 2 else self.index + 0.5
        return np.zeros(1, np.float32), 0.0, False, False, {"value": value}


def test_workers_whose_infos_have_other_types_as_sync_vector_env():
    """Two workers' record arrays with the same keys but other field types are not read as
    one array (a float64's bytes taken for an int64's): the infos are those
    ``SyncVectorEnv`` gathers."""
    fns = [functools.partial(TypedInfoEnv, index) for index in range(4)]
    with BatchVectorEnv(fns, AutoresetMode.NEXT_STEP, workers=2) as env, \
            closing(SyncVectorEnv(fns)) as reference:
        assert_same_vector_steps(env, reference, seed=0, steps=2)
        infos = env.step(np.zeros(4, np.int64))[-1]
    # (Gymnasium's array takes the first env's type: 2.5 and 3.5 become 2 and 3)
    assert infos["value"].tolist() == [0, 1, 2, 3]


def test_joined_info_lists_keep_the_rows_of_one_already_read():
    """``InfoList.join`` of a member's infos that were read already (unpickled into dicts,
    its parts let go): their rows are still there, in order."""
    first = InfoList([(2, info_columns([{"a": 1}, {"a": 2}]))])
    assert first[1] == {"a": 2}  # (read: the dicts are made)
    second = InfoList([(1, [{"b": 3.5}])])
    joined = InfoList.join([first, second, InfoList([(1, None)])])
    assert len(joined) == 4
    assert list(joined) == [{"a": 1}, {"a": 2}, {"b": 3.5}, {}]


def test_partial_resets_and_disabled_autoreset_as_sync_vector_env():
    fns = [make("CartPole-v1", 10)] * 4
    mask = np.array([True, False, True, False])
    with BatchVectorEnv(fns, "disabled", workers=2) as env, \
            closing(SyncVectorEnv(fns, autoreset_mode=AutoresetMode.DISABLED)) as reference:
        assert env.metadata["autoreset_mode"] is AutoresetMode.DISABLED
        assert_same_value(env.reset(seed=3), reference.reset(seed=3))
        actions = np.ones(4, np.int64)
        for t in range(40):
            got, expected = env.step(actions), reference.step(actions)
            assert_same_value(got, expected, f"step {t}")
            done = expected[2] | expected[3]
            if done.any():
                # Seeded, or unseeded with options (the env's RNG carries on).
                seeds = [100 + t + i for i in range(4)] if t % 2 else None
                options = {"reset_mask": done} if t % 2 else {"reset_mask": done, "low": -0.1}
                assert_same_value(env.reset(seed=seeds, options=dict(options)),
                                  reference.reset(seed=seeds, options=dict(options)))
        assert_same_value(env.reset(options={"reset_mask": mask}),
                          reference.reset(options={"reset_mask": mask}))
        env.step(actions)
        with pytest.raises(RuntimeError, match="reset_mask"):
            for _ in range(12):  # an episode ends within 10 steps
                env.step(actions)


class PictureEnv(InfoEnv):
    """``render()`` gives a tiny picture of the env's index and step."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 7}
    render_mode = "rgb_array"

    def render(self):
        return np.full((2, 3, 3), 10 * self.index + self.t, np.uint8)


def test_call_get_attr_set_attr_and_render_as_sync_vector_env():
    fns = [make("CartPole-v1", 50)] * 3
    with BatchVectorEnv(fns, workers=2) as env, closing(SyncVectorEnv(fns)) as reference:
        env.reset(seed=0)
        reference.reset(seed=0)
        assert env.get_attr("spec") == reference.get_attr("spec")
        assert env.get_attr("gravity") == reference.get_attr("gravity")  # a wrapped env's
        assert env.np_random_seed == reference.np_random_seed
        for target in (env, reference):
            target.set_attr("gravity", [1.0, 2.0, 30.0])
        assert env.get_attr("gravity") == reference.get_attr("gravity") == (1.0, 2.0, 30.0)
        for t in range(5):  # the physics use it (not an attribute of an outer wrapper)
            assert_same_value(env.step(np.ones(3, np.int64)),
                              reference.step(np.ones(3, np.int64)), f"step {t}")
        env.set_attr("gravity", 5.0)
        assert env.call("gravity") == (5.0, 5.0, 5.0)
        with pytest.raises(ValueError, match="one value per env"):
            env.set_attr("gravity", [1.0])
    fns = [functools.partial(PictureEnv, index) for index in range(3)]
    with BatchVectorEnv(fns, workers=2) as env, closing(SyncVectorEnv(fns)) as reference:
        assert env.render_mode == "rgb_array" and env.metadata["render_fps"] == 7
        env.reset(seed=0)
        reference.reset(seed=0)
        for t in range(9):  # episodes end at steps 4, 5 and 6: a frame shows the final state
            env.step(np.ones(3, np.int64))
            reference.step(np.ones(3, np.int64))
            assert_same_value(env.render(), reference.render(), f"step {t}")
            assert env.get_attr("t") == reference.get_attr("t")
        unwrapped = env.get_attr("unwrapped")  # an env is handed out, not called
        assert [handle.index for handle in unwrapped] == [0, 1, 2]


def test_spaces_and_make_vec():
    with make_vec("CartPole-v1", 3, vector_kwargs={"workers": 1},
                  wrappers=[gym.wrappers.TimeAwareObservation]) as env:
        assert env.num_envs == 3 and env.single_action_space == gym.spaces.Discrete(2)
        assert env.action_space == gym.spaces.MultiDiscrete([2, 2, 2])
        assert env.single_observation_space.shape == (5,)  # the wrapper's time feature
        assert env.observation_space.shape == (3, 5)
        observ, infos = env.reset(seed=0)
        assert observ.shape == (3, 5) and infos == {}
    with pytest.raises(EnvSpecError, match="NoSuchEnv"):
        make_vec("NoSuchEnv-v0", 2)


def test_make_vec_builds_the_envs_of_gymnasiums_make_vec():
    """Its kwargs reach gymnasium.make, its wrappers wrap each env in their order, and the
    autoreset mode may come in vector_kwargs, as gymnasium.make_vec takes them."""
    wrappers = [gym.wrappers.TimeAwareObservation,
                lambda env: gym.wrappers.TransformObservation(env, lambda o: o[::-1].copy(),
                                                              None)]
    options = dict(max_episode_steps=7, sutton_barto_reward=True)
    with make_vec("CartPole-v1", 3, vector_kwargs={"workers": 1, "autoreset_mode": "same_step"},
                  wrappers=wrappers, **options) as env, \
            closing(gym.make_vec("CartPole-v1", 3, "sync", wrappers=wrappers, vector_kwargs={
                "autoreset_mode": AutoresetMode.SAME_STEP}, **options)) as reference:
        assert env.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        assert_same_vector_steps(env, reference, seed=6, steps=20)


def test_make_vec_takes_an_id_after_the_module_that_registers_it():
    """As gymnasium.make and make_vec do: "module:EnvId" imports the module (which registers
    the env) first."""
    with make_vec("gymnasium.envs.classic_control:CartPole-v1", 2,
                  vector_kwargs={"backend": "inline"}) as env:
        assert env.single_action_space == gym.spaces.Discrete(2)
        assert env.get_attr("spec")[0].id == "CartPole-v1"
    with pytest.raises(EnvSpecError, match=r"^env 'no_such_module:CartPole-v1': cannot import "
                                           r"module 'no_such_module'"):
        make_vec("no_such_module:CartPole-v1", 2)


def test_gymnasium_vector_wrappers_work_on_it():
    env = gym.wrappers.vector.RecordEpisodeStatistics(
        BatchVectorEnv([make("Pendulum-v1", 10)] * 2, workers=1))
    with closing(env):
        env.reset(seed=0)
        for _ in range(11):
            *_, infos = env.step(np.zeros((2, 1), np.float32))
            if "episode" in infos:
                break
        assert infos["_episode"].all() and infos["episode"]["l"].tolist() == [10, 10]


def test_an_env_failure_names_the_env_and_restarts_report_in_infos(tmp_path):
    def faulty(fault, at_step):
        return lambda: FaultyEnv(gym.make("CartPole-v1"), fault, at_step=at_step)

    fns = [make("CartPole-v1", 100)] * 3 + [faulty("raise", 3)]
    with BatchVectorEnv(fns, workers=2) as env:
        env.reset(seed=0)
        env.step(np.zeros(4, np.int64))
        env.step(np.zeros(4, np.int64))
        with pytest.raises(EnvRaisedError) as info:
            env.step(np.zeros(4, np.int64))
        assert info.value.env_index == 3
    with BatchVectorEnv([make("CartPole-v1", 100)] * 2 + [faulty("exit", 2)] * 2,
                        workers=2, max_restarts=1) as env:
        first, _ = env.reset(seed=0)
        env.step(np.zeros(4, np.int64))
        observ, reward, terminated, truncated, infos = env.step(np.zeros(4, np.int64))
        assert infos["_restarted"].tolist() == [False, False, True, True]
        assert infos["restarted"][2:].all() and not reward[2:].any()
        assert env.batch.restarts == 1
        env.step(np.zeros(4, np.int64))  # the fresh worker's envs step on
    with BatchVectorEnv([faulty("hang", 2)] * 2, workers=1, timeout=0.5) as env:
        env.reset(seed=0)
        env.step(np.zeros(2, np.int64))
        with pytest.raises(EnvTimeoutError) as info:
            env.step(np.zeros(2, np.int64))
        assert info.value.env_indices == range(0, 2)


def test_close_stops_every_worker_process(gone):
    env = BatchVectorEnv([make("CartPole-v1", 10)] * 4, workers=2)
    pids = [worker.pid for worker in env.batch.workers]
    assert len(pids) == 2
    env.reset(seed=0)
    env.close()
    assert env.closed and gone(pids, 5.0) == []
    env.close()  # idempotent


def test_bad_input_gets_clear_errors():
    cartpole = make("CartPole-v1", 10)
    with pytest.raises(TypeError, match="list of functions"):
        BatchVectorEnv(cartpole)
    with pytest.raises(TypeError, match=r"env_fns\[1\] is the string 'CartPole-v1'.*make_vec"):
        BatchVectorEnv([cartpole, "CartPole-v1"])
    with pytest.raises(TypeError, match=r"env_fns\[0\] must be a function.*CartPoleEnv"):
        BatchVectorEnv([gym.make("CartPole-v1").unwrapped])
    with pytest.raises(ValueError, match="at least one"):
        BatchVectorEnv([])
    with pytest.raises(ValueError, match="autoreset_mode must be.*'next_step'"):
        BatchVectorEnv([cartpole], "sometimes")
    with pytest.raises(TypeError, match=r"unknown options \['worker'\].*workers"):
        BatchVectorEnv([cartpole], worker=2)
    acrobot = make("Acrobot-v1", 10)
    with pytest.raises(SpaceMismatchError, match="env 1 has Box.*while env 0 has Box"):
        BatchVectorEnv([cartpole, acrobot], workers=2)
    with pytest.raises(EnvError, match="all envs of a worker need equal spaces"):
        BatchVectorEnv([cartpole, acrobot], workers=1)
    with BatchVectorEnv([cartpole] * 2, workers=1) as env:
        env.reset(seed=0)
        with pytest.raises(ValueError, match=r"actions must have shape \(2,\)"):
            env.step(np.zeros((2, 1), np.int64))
        with pytest.raises(ValueError, match="actions out of range"):
            env.step(np.array([0, 2]))
        with pytest.raises(ValueError, match="one per env"):
            env.reset(seed=[1, 2, 3])
        with pytest.raises(TypeError, match="reset_mask.*bool numpy array of shape"):
            env.reset(options={"reset_mask": [True, False]})
        with pytest.raises(ValueError, match="at least one env"):
            env.reset(options={"reset_mask": np.zeros(2, bool)})
        env.step(np.zeros(2, np.int64))  # still usable after the errors


def test_bad_actions_after_an_episode_end_leave_the_autoreset_intact():
    fns = [make("Pendulum-v1", 5)] * 2
    with BatchVectorEnv(fns, workers=1) as env, closing(SyncVectorEnv(fns)) as reference:
        assert_same_vector_steps(env, reference, seed=4, steps=5)  # both episodes end
        with pytest.raises(ValueError, match="actions must be finite"):
            env.step(np.full((2, 1), np.nan, np.float32))
        for t in range(8):
            actions = np.full((2, 1), 0.1 * t, np.float32)
            assert_same_value(env.step(actions), reference.step(actions), f"step {t}")


def test_returned_observations_are_not_changed_by_later_calls():
    fns = [functools.partial(gym.make, "CartPole-v1")] * 2
    with BatchVectorEnv(fns, "disabled", workers=1) as env:
        env.reset(seed=0)
        observ = env.step(np.ones(2, np.int64))[0]
        kept = observ.copy()
        env.reset(options={"reset_mask": np.array([True, False])})
        env.step(np.ones(2, np.int64))
        np.testing.assert_array_equal(observ, kept)
