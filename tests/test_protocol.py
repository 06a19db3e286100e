"""One conformance suite for every transport of the ``Worker`` protocol.

The same envs, seeds and actions go through envs in this process, one child
process per env (``ExternalProcess``), shared-memory workers (``EnvWorker``)
and Ray actors (``RayEnvWorker``, on a real cluster on 127.0.0.1). Each must
give the trajectories of plain Gymnasium envs stepped one after the other
(``helpers.Sequential``), be driven through the same
``step_async``/``step_wait`` and ``reset_async``/``reset_wait`` pairs, raise the
same errors for the same faults, forward attribute access, reset the envs it is
told to reset instead of stepping them, and (except in-process envs) restart a
failed worker; a ``BatchVectorEnv`` on it steps as Gymnasium's ``SyncVectorEnv``. A
new transport joins by adding an entry to ``TRANSPORTS`` (and its
``batch_env_from`` options to ``VECTOR_LAYOUTS``).
"""

from __future__ import annotations

import functools
from contextlib import closing
import sys

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest

from batchrl.envs import (BatchEnv, BatchVectorEnv, EnvRaisedError, EnvWorker, ExternalProcess,
                          LocalWorker, RayEnvWorker)
from batchrl.nested import leaf_spaces, leaves
from batchrl.testing.faults import FaultyEnv
from batchrl.testing.envs import ImageAndFlag, PixelSide
from helpers import (CountingEnv, Sequential, assert_same_log, assert_same_vector_steps,
                     fails_at, make_cartpole, make_cheetah, raise_site, rollout)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _local(constructors):
    return [make() for make in constructors]


def _process(constructors):
    return [ExternalProcess(make) for make in constructors]


def _shared_memory(constructors):
    # Two workers, so that the batch has more than one member.
    half = len(constructors) // 2
    return [EnvWorker(constructors[:half]), EnvWorker(constructors[half:])]


def _ray(constructors):
    from batchrl.envs.ray.worker import RayEnvWorker
    half = len(constructors) // 2
    return [RayEnvWorker(constructors[:half], timeout=60),
            RayEnvWorker(constructors[half:], timeout=60)]


TRANSPORTS = {"local": _local, "process": _process, "shared-memory": _shared_memory,
              "ray": _ray}
# The Worker that BatchEnv drives for each transport's members, and how many of them there are
# for four envs (an ExternalProcess is a front over an EnvWorker of its env).
MEMBERS = {"local": (LocalWorker, 1), "process": (EnvWorker, 4),
           "shared-memory": (EnvWorker, 2), "ray": (RayEnvWorker, 2)}


@pytest.fixture(params=list(TRANSPORTS))
def transport(request):
    """``build(constructors, **batch_kwargs)``: a ``BatchEnv`` of the
    transport's members, closed when the test ends."""
    if request.param == "ray":
        pytest.importorskip("ray")
        request.getfixturevalue("cluster")
    created = []

    def build(constructors, **kwargs):
        members = TRANSPORTS[request.param](constructors)
        batch = BatchEnv(members, **kwargs)
        created.append(batch)
        return batch

    build.name = request.param
    yield build
    for batch in created:
        batch.close()


@pytest.mark.parametrize("make, dtype", [(make_cartpole, None), (make_cheetah, np.float32)],
                         ids=["CartPole", "HalfCheetah"])
def test_trajectories_are_those_of_in_process_envs(transport, make, dtype):
    reference = Sequential([make() for _ in range(4)])
    try:
        expected = rollout(reference, dtype)
    finally:
        reference.close()
    assert_same_log(rollout(transport([make] * 4), dtype), expected)


def test_uint8_images_travel_as_uint8(transport):
    """Pixels cross every transport as bytes (shared memory, pipes, Ray's object store)."""
    reference = Sequential([PixelSide() for _ in range(4)])
    try:
        expected = rollout(reference, None)
    finally:
        reference.close()
    got = rollout(transport([PixelSide] * 4), None)
    assert got[0][2].dtype == np.uint8 and got[1][1].dtype == np.uint8
    assert_same_log(got, expected)  # (dtypes included)


@pytest.mark.parametrize("make", [ImageAndFlag, functools.partial(ImageAndFlag,
                                                                    tuple_observations=True),
                                  functools.partial(gym.make, "Blackjack-v1")],
                         ids=["dict", "tuple", "Blackjack"])
def test_dict_and_tuple_observations_travel_part_by_part(transport, make):
    """Structured observations cross every transport as dicts and tuples of arrays, each part
    in its space's dtype, in the space's order (not the order an env builds its dicts in)."""
    reference = Sequential([make() for _ in range(4)])
    try:
        expected = rollout(reference, None)
    finally:
        reference.close()
    got = rollout(transport([make] * 4), None)
    space = reference.observation_space
    if isinstance(space, gym.spaces.Dict):
        assert list(got[1][1]) == list(space.keys()) == ["flag", "image"]
    assert all(np.asarray(part).dtype == leaf.dtype and part.shape[1:] == leaf.shape
               for part, (_, leaf) in zip(leaves(got[1][1]), leaf_spaces(space)))
    assert_same_log(got, expected)


@pytest.mark.parametrize("blocking", [False, True], ids=["parallel", "blocking"])
def test_every_member_is_driven_through_the_async_and_wait_pairs(transport, blocking,
                                                                 monkeypatch):
    calls = []
    for cls in (LocalWorker, EnvWorker, RayEnvWorker):
        for name in ("step_async", "step_wait", "reset_async", "reset_wait", "step", "reset"):
            def record(self, *args, _original=getattr(cls, name), _name=name, **kwargs):
                calls.append((type(self), id(self), _name))
                return _original(self, *args, **kwargs)
            monkeypatch.setattr(cls, name, record)
    batch = transport([CountingEnv] * 4, blocking=blocking)
    kind, count = MEMBERS[transport.name]
    for operation, run in [("reset", lambda: batch.reset(seed=0)),
                           ("step", lambda: batch.step(np.zeros(4, np.int64)))]:
        calls.clear()
        run()
        assert {cls for cls, _, _ in calls} == {kind}
        halves = [(member, name) for _, member, name in calls]
        members = list(dict.fromkeys(member for member, _ in halves))
        assert len(members) == count
        if blocking or kind is LocalWorker:  # each member's request, then its answer
            expected = [(m, f"{operation}_{half}") for m in members for half in ("async", "wait")]
            assert halves == expected
        else:  # every request sent before any answer is waited for
            assert [name for _, name in halves] == ([f"{operation}_async"] * count
                                                    + [f"{operation}_wait"] * count)
            assert sorted(halves) == sorted(
                (m, f"{operation}_{half}") for m in members for half in ("async", "wait"))
    observ, *_ = batch.step(np.zeros(4, np.int64))
    assert observ[:, 0].tolist() == [2.0] * 4


def test_an_env_raising_in_step_is_named_with_its_batch_index(transport):
    batch = transport([CountingEnv, CountingEnv, CountingEnv, fails_at(3)])
    batch.reset(seed=0)
    batch.step(np.zeros(4, np.int64))
    batch.step(np.zeros(4, np.int64))
    with pytest.raises(EnvRaisedError) as info:
        batch.step(np.zeros(4, np.int64))
    error = info.value
    assert error.env_index == 3 and error.operation == "step"
    assert error.remote_type == "ValueError" and "boom at step 3" in str(error)
    assert raise_site(CountingEnv.step, "raise ValueError") in error.remote_traceback


def raises_in_reset(count):
    return lambda: FaultyEnv(CountingEnv(), "raise", at_step=count, in_reset=True)


def test_an_env_raising_in_reset_is_named_with_its_batch_index(transport):
    """A reset of chosen rows names the env that raised by its batch index, not by its
    position among the rows asked for or as its whole worker."""
    batch = transport([CountingEnv, CountingEnv, CountingEnv, raises_in_reset(2)])
    batch.reset(seed=0)
    with pytest.raises(EnvRaisedError) as info:
        batch.reset([1, 3])
    error = info.value
    assert error.env_index == 3 and error.operation == "reset"
    assert error.remote_type == "RuntimeError" and "injected fault in reset 2" in str(error)


def test_attributes_and_methods_reach_the_env(transport):
    batch = transport([CountingEnv] * 4)
    batch.reset(seed=0)
    batch.step(np.zeros(4, np.int64))
    assert [env.count for env in batch.envs] == [1, 1, 1, 1]
    assert batch.envs[2].double(3, offset=1) == 7
    batch.reset([1, 2])  # (counts that tell the envs apart)
    batch.step(np.zeros(4, np.int64))
    assert [env.count for env in batch.envs] == [2, 1, 1, 2]
    assert [env.get_wrapper_attr("count") for env in batch.envs] == [2, 1, 1, 2]


def test_a_failed_worker_restarts_or_in_process_envs_raise(transport):
    batch = transport([CountingEnv, CountingEnv, CountingEnv, fails_at(2)], max_restarts=1)
    batch.reset(seed=0)
    batch.step(np.zeros(4, np.int64))
    if transport.name == "local":
        with pytest.raises(EnvRaisedError, match="boom at step 2"):
            batch.step(np.zeros(4, np.int64))
        return
    old = batch.workers[-1]
    observ, reward, *_ = batch.step(np.zeros(4, np.int64))
    rows, first = batch.restarted
    # The failed env's worker was replaced (a new process or actor): its envs are in new
    # episodes, whose first observation is CountingEnv's zeros.
    assert 3 in rows.tolist() and batch.restarts == 1
    assert batch.workers[-1] is not old and old.closed and not first.any()
    assert np.array_equal(observ[rows], first) and not reward[rows].any()
    kept = [i for i in range(4) if i not in rows.tolist()]
    assert observ[kept, 0].tolist() == [2.0] * len(kept)


def test_autoreset_envs_are_reset_instead_of_stepped(transport):
    batch = transport([CountingEnv] * 4)
    batch.reset(seed=0)
    batch.step(np.zeros(4, np.int64))
    autoreset = np.array([False, True, False, True])
    observ, reward, terminated, truncated, infos = batch.step(np.zeros(4, np.int64), autoreset)
    assert observ[:, 0].tolist() == [2, 0, 2, 0] and reward.tolist() == [2, 0, 2, 0]
    assert not terminated.any() and not truncated.any()
    assert list(infos) == [{"count": 2}, {"reset": True}, {"count": 2}, {"reset": True}]
    observ, *_ = batch.step(np.zeros(4, np.int64))
    assert observ[:, 0].tolist() == [3, 1, 3, 1]
    assert [env.count for env in batch.envs] == [3, 1, 3, 1]


def assert_steps_as_in_process(transport, steps):
    """``steps(batch)`` (a list of arrays) gives the same arrays on four CartPoles of 3-step
    episodes on ``transport`` as on the same envs in process."""
    def make():
        return gym.make("CartPole-v1", max_episode_steps=3)

    reference = Sequential([make() for _ in range(4)])
    try:
        expected = steps(reference)
    finally:
        reference.close()
    for got, want in zip(steps(transport([make] * 4)), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_ended_episode_is_reset_once_when_stepped_with_autoreset(transport):
    """Worker processes reset an env as soon as its episode ends (prefetch); the step that
    autoresets it must use that reset, not reset it again (a second draw from its generator)."""
    def steps(batch):
        batch.reset(seed=5)
        for _ in range(3):
            *_, terminated, truncated, _ = batch.step(np.zeros(4, np.int64))
        observ = [batch.step(np.ones(4, np.int64), terminated | truncated)[0]]
        return observ + [batch.step(np.zeros(4, np.int64))[0]]

    assert_steps_as_in_process(transport, steps)


# The layout options that put a BatchVectorEnv's envs on each transport.
VECTOR_LAYOUTS = {"local": dict(backend="inline"), "process": dict(backend="process"),
                  "shared-memory": dict(backend="workers", workers=2),
                  "ray": dict(backend="ray", workers=2, timeout=60)}


@pytest.mark.parametrize("observations", ["array", "dict"])
@pytest.mark.parametrize("mode", [gym.vector.AutoresetMode.NEXT_STEP,
                                  gym.vector.AutoresetMode.SAME_STEP], ids=["next", "same"])
def test_vector_env_steps_as_sync_vector_env(transport, mode, observations):
    make = (functools.partial(gym.make, "CartPole-v1", max_episode_steps=25)
            if observations == "array" else functools.partial(ImageAndFlag, size=8, length=7))
    with BatchVectorEnv([make] * 4, mode, **VECTOR_LAYOUTS[transport.name]) as env, \
            closing(gym.vector.SyncVectorEnv([make] * 4, autoreset_mode=mode)) as reference:
        assert_same_vector_steps(env, reference, seed=7, steps=120)


def test_an_autoreset_step_after_a_reset_is_a_second_reset(transport):
    """A reset that a worker answered with its prefetched reset used that reset up: an
    autoreset in the next step is another reset (a second draw), as in process."""
    def steps(batch):
        batch.reset(seed=5)
        for _ in range(3):
            batch.step(np.zeros(4, np.int64))  # all four episodes end (truncated)
        observ = [batch.reset([0, 1]), batch.reset([2, 3], seed=9)]
        observ.append(batch.step(np.ones(4, np.int64), np.array([True, True, True, False]))[0])
        return observ + [batch.step(np.zeros(4, np.int64))[0]]

    assert_steps_as_in_process(transport, steps)
