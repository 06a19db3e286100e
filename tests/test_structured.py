"""Dict and Tuple observations: batched part by part (``batchrl.nested``), kept as a dict or tuple
of tensors by ``TensorBatchEnv``, packed into ``uint8`` rows for BatchPPO's memory
(``batchrl.parts.packing``) and learned through train.py. The transports are checked in
``test_protocol.py`` (every transport, and ``BatchVectorEnv`` against ``SyncVectorEnv``)."""

from __future__ import annotations

import json
import sys

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
import torch

from batchrl.algos import BatchPPO
from batchrl.envs import BatchEnv, EnvWorker, ExternalProcess
from batchrl.envs.spaces import check_space
from batchrl.errors import UnsupportedSpaceError
from batchrl.nested import leaf_spaces, leaves, map_nested, put, stack_as, take, unstack
from batchrl.parts.packing import PackedObservations, packing_for, stored_observations
from batchrl.parts.rollout import RolloutBuffer, rollout_tensors
from batchrl.tensor_env import TensorBatchEnv
from batchrl.testing.envs import ImageAndFlag
from batchrl.train import main as train_main

# Env classes defined here reach the env workers by value: a worker does not import this
# module (and torch with it) to build them.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SPACE = gym.spaces.Dict({
    "camera": gym.spaces.Box(0, 255, (3, 4, 2), np.uint8),
    "joints": gym.spaces.Tuple((gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(5))),
    "depth": gym.spaces.Box(0, 255, (5,), np.uint8)})


def test_parts_follow_the_space_whatever_order_an_env_builds_its_dicts_in():
    assert [path for path, _ in leaf_spaces(SPACE)] == ["camera", "depth", "joints.0", "joints.1"]
    rows = [SPACE.sample() for _ in range(3)]
    shuffled = [{"joints": row["joints"], "depth": row["depth"], "camera": row["camera"]}
                for row in rows]
    batch = stack_as(SPACE, shuffled)
    assert list(batch) == ["camera", "depth", "joints"]
    assert batch["camera"].shape == (3, 3, 4, 2) and batch["camera"].dtype == np.uint8
    assert batch["joints"][1].shape == (3,) and batch["joints"][1].dtype == np.int64
    np.testing.assert_array_equal(take(batch, 2)["joints"][0], rows[2]["joints"][0])
    put(batch, [0, 2], take(batch, [2, 0]))
    np.testing.assert_array_equal(batch["depth"][0], rows[2]["depth"])


class ListTupleEnv(gym.Env):
    """A Tuple observation given as a list (Gymnasium's Tuple space contains lists too)."""

    observation_space = gym.spaces.Tuple((gym.spaces.Box(-1, 1, (3,), np.float32),
                                          gym.spaces.Box(-1, 1, (2,), np.float32)))
    action_space = gym.spaces.Discrete(2)

    def _observ(self) -> list:
        return [np.full(3, self.t / 10, np.float32), np.full(2, -self.t / 10, np.float32)]

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._observ(), {}

    def step(self, action):
        self.t += 1
        return self._observ(), 0.0, self.t >= 2, False, {}


def test_a_tuple_observation_given_as_a_list_keeps_its_parts_through_steps_and_resets():
    with BatchEnv([EnvWorker([ListTupleEnv] * 2)]) as env:
        env.reset(seed=0)
        env.step(np.zeros(2, np.int64))
        observ, _, terminated, _, _ = env.step(np.zeros(2, np.int64))
        assert terminated.all() and isinstance(observ, tuple)
        np.testing.assert_array_equal(observ[1], np.full((2, 2), -0.2, np.float32))
        fresh = env.reset([0, 1])  # (the worker reset them while the step was answered)
        assert isinstance(fresh, tuple) and [part.shape for part in fresh] == [(2, 3), (2, 2)]
        np.testing.assert_array_equal(fresh[0], np.zeros((2, 3), np.float32))


def test_external_process_keeps_scalar_observations_scalars():
    """(A Discrete observation is a numpy integer, not a 0-d array, as from the env itself.)"""
    with ExternalProcess("CliffWalking-v1") as env:
        observ, _ = env.reset(seed=0)
        assert type(observ) is np.int64
        assert type(env.step(0)[0]) is np.int64


def test_an_empty_dict_is_no_observation_space():
    with pytest.raises(UnsupportedSpaceError, match="needs at least one part"):
        check_space("observation", gym.spaces.Dict({}))


class LooseEnv(gym.Env):
    """Declares float32 observations of a ``shape`` (a Box, or a Dict of an empty Dict and
    the Box) and returns float64 ones, of ``given`` shape."""

    action_space = gym.spaces.Discrete(2)

    def __init__(self, nested: bool = False, shape: tuple = (2,), given: tuple = (2,)):
        box = gym.spaces.Box(-1, 1, shape, np.float32)
        self.observation_space = (gym.spaces.Dict({"empty": gym.spaces.Dict({}), "x": box})
                                  if nested else box)
        self.nested, self.given = nested, given

    def _observ(self):
        value = np.full(self.given, 0.5, np.float64)
        return {"empty": {}, "x": value} if self.nested else value

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._observ(), {}

    def step(self, action):
        return self._observ(), 0.0, True, False, {}


@pytest.mark.parametrize("backend", ["inline", "workers"])
@pytest.mark.parametrize("nested", [False, True], ids=["box", "dict"])
def test_envs_in_this_process_batch_observations_as_a_worker_process_does(backend, nested):
    """The space's dtype and shape whichever transport: an observation of another dtype is
    converted, one of another shape is an error naming the env; an empty part is no leaf."""
    from batchrl.envs.factory import batch_env_from
    from batchrl.envs.errors import EnvRaisedError

    with batch_env_from(lambda: LooseEnv(nested), 2, backend=backend, workers=1) as env:
        observ = env.reset(seed=0)
        for _ in range(2):  # (the second step follows the episodes' ends)
            box = observ["x"] if nested else observ
            assert box.dtype == np.float32 and box.tolist() == [[0.5, 0.5]] * 2
            observ = env.step(np.zeros(2, np.int64))[0]
    wrong = batch_env_from(lambda: LooseEnv(nested, given=(3,)), 2, backend=backend, workers=1)
    with wrong, pytest.raises(EnvRaisedError, match=r"env 0 \(.*\) failed in reset\(\): "
                                                    r"ValueError: could not broadcast"):
        wrong.reset(seed=0)


def test_packed_rows_keep_floats_bit_exact_and_pixels_as_bytes():
    packing = PackedObservations(SPACE)
    # Floats first: the joints (3 values) and the Discrete part (1); then 24 + 5 image bytes.
    assert packing.float_size == 4 and packing.size == 16 + 24 + 8  # (padded to 4 bytes)
    assert [(path, offset, size) for path, offset, size, _ in packing.pixel_parts] == [
        ("camera", 16, 24), ("depth", 40, 5)]
    rows = [SPACE.sample() for _ in range(6)]
    batch = map_nested(torch.as_tensor, stack_as(SPACE, rows))
    floats = packing.floats(batch, torch.device("cpu"))
    packed = packing.pack(batch, floats)
    assert packed.dtype == torch.uint8 and packed.shape == (6, packing.size)
    unpacked = packing.unpack(packed.reshape(2, 3, -1))  # any leading dimensions
    assert unpacked.data_ptr() == packed.data_ptr()  # a view, not a copy
    assert torch.equal(unpacked.reshape(6, -1)[:, :3], batch["joints"][0])
    assert torch.equal(unpacked.reshape(6, -1)[:, 3], batch["joints"][1].float())
    assert torch.equal(packed[:, 16:40], batch["camera"].reshape(6, -1))
    assert torch.equal(packed[:, 40:45], batch["depth"])
    halved = packing.with_floats(packed, floats / 2)
    assert torch.equal(packing.unpack(halved), floats / 2) and torch.equal(halved[:, 16:],
                                                                           packed[:, 16:])


def test_tensor_batch_env_keeps_a_dict_of_tensors():
    def make():
        return ImageAndFlag(size=8)
    reference = BatchEnv([make() for _ in range(4)])
    env = TensorBatchEnv(BatchEnv([EnvWorker([make] * 4)]))
    try:
        expected = reference.reset(seed=3)
        observ = env.reset(seed=3)
        assert list(observ) == ["flag", "image"]
        assert observ["image"].dtype == torch.uint8 and observ["flag"].dtype == torch.float32
        for _ in range(8):  # (within an episode: a worker resets finished envs at once)
            actions = np.array([0, 1, 1, 0])
            expected = reference.step(actions)[0]
            observ, reward, done = env.step(torch.as_tensor(actions))
            for got, want in zip(leaves(observ), leaves(expected)):
                np.testing.assert_array_equal(got.numpy(), want)
        rows = env.reset(torch.tensor([2, 0]), seed=[5, 6])
        expected = reference.reset([2, 0], seed=[5, 6])
        assert rows["image"].shape == (2, 1, 8, 8)
        for got, want in zip(leaves(rows), leaves(expected)):
            np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(env.observ["image"][[2, 0]].numpy(), expected["image"])
        assert float(env.reward[2]) == 0.0 and float(env.done[0]) == 0.0
    finally:
        env.close()
        reference.close()


def test_batch_ppo_rejects_what_it_cannot_take():
    multi = gym.spaces.Dict({"x": gym.spaces.MultiBinary(3)})
    with pytest.raises(UnsupportedSpaceError, match=r"a Dict or Tuple of Box and Discrete"):
        BatchPPO(multi, gym.spaces.Discrete(2), 2)
    vectors = gym.spaces.Tuple((gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(4)))
    with pytest.raises(UnsupportedSpaceError, match=r"torso 'nature_cnn' needs an image"):
        BatchPPO(vectors, gym.spaces.Discrete(2), 2, torso="nature_cnn")
    algo = BatchPPO(vectors, gym.spaces.Discrete(2), 2)  # torso "mlp": the float parts
    action, _ = algo.act((torch.zeros(2, 3), torch.tensor([1.0, 3.0])))
    assert action.shape == (2,)
    # An image part too small for the torso: the error names the part.
    tiny = gym.spaces.Dict({"map": gym.spaces.Box(0, 255, (8, 8), np.uint8)})
    with pytest.raises(UnsupportedSpaceError, match=r"observation part 'map': torso "
                                                    r"'nature_cnn' cannot take images of 8x8"):
        BatchPPO(tiny, gym.spaces.Discrete(2), 2, torso="nature_cnn")


def test_uint8_parts_that_are_not_images_go_beside_the_convolutional_torso():
    """A uint8 vector (counts, say) beside an image: the image gets the convolutional torso,
    the vector its scaled bytes, as under torso 'mlp'."""
    space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (36, 36, 3), np.uint8),
                             "inventory": gym.spaces.Box(0, 255, (4,), np.uint8),
                             "speed": gym.spaces.Box(-1, 1, (2,), np.float32)})
    algo = BatchPPO(space, gym.spaces.Discrete(2), 2, torso="nature_cnn")
    torso = algo.policy.body.torso
    assert [type(part).__name__ for part in torso.torsos] == ["ConvTorso", "PixelInput"]
    assert torso.out_size == 2 + 512 + 4
    observ = {"image": torch.randint(0, 256, (2, 36, 36, 3), dtype=torch.uint8),
              "inventory": torch.tensor([[0, 1, 2, 255], [3, 4, 5, 6]], dtype=torch.uint8),
              "speed": torch.zeros(2, 2)}
    action, _ = algo.act(observ)
    assert action.shape == (2,)


# One torch thread for the update: the test suite runs two tests at a time on two cores.
STRUCTURED_TASK = ["--set", "env.id=batchrl.testing.envs:image_and_flag",
                   "--set", "env.kwargs={length=10}", "--set", "env.eval_kwargs={length=20}",
                   "--set", "env.max_length=20", "--set", "algorithm.update_threads=1",
                   "--set", "train.eval_every=2", "--set", "train.eval_episodes=16",
                   "--set", "algorithm.rollout_length=32", "--set", "algorithm.minibatch_size=64",
                   "--set", "algorithm.policy_lr=1e-3", "--set", "algorithm.value_lr=1e-3",
                   "--set", "algorithm.discount=0.9", "--set", "algorithm.lr_schedule=constant",
                   "--set", "algorithm.policy_layers=[64]",
                   "--set", "algorithm.value_layers=[64]",
                   "--set", "train.eval_actions=mean"]  # (the Atari configs sample)


def records(logdir) -> list[dict]:
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ppo_learns_from_an_image_and_a_vector_through_train_py(tmp_path):
    """Neither part alone beats a random policy (10 of 20 in evaluation): the Nature CNN's
    features of the image and the vector, concatenated, reach 20. The dicts cross shared
    memory (a worker process)."""
    logdir = tmp_path / "run"
    assert train_main(["--config", "atari/pong", *STRUCTURED_TASK, "--logdir", str(logdir),
                       "--no-progress", "--set", "env.backend=workers", "--set", "env.workers=1",
                       "--set", "train.steps=6000"]) == 0
    evals = [r for r in records(logdir) if r["phase"] == "eval"]
    assert evals[0]["score"] < 17.0 and evals[-1]["score"] >= 19.0, evals


def test_tuple_observations_train_the_same_for_the_same_seed(tmp_path):
    """A Tuple of the image and the vector through an MLP torso (pixels scaled), twice."""
    runs = []
    for name in ("a", "b"):
        logdir = tmp_path / name
        assert train_main(["--config", "atari/pong", *STRUCTURED_TASK, "--logdir", str(logdir),
                           "--no-progress", "--set", "env.backend=inline",
                           "--set", "env.kwargs={length=10, size=12, tuple_observations=true}",
                           "--set", "env.eval_kwargs={length=20, size=12, "
                                    "tuple_observations=true}",
                           "--set", "algorithm.torso=mlp", "--set", "algorithm.shared_torso=false",
                           "--set", "train.steps=1024", "--set", "train.eval_every=1"]) == 0
        runs.append([(r["phase"], r["step"], r["score"]) for r in records(logdir)])
    assert runs[0] == runs[1] and len(runs[0]) >= 4


def test_rollouts_hold_packed_rows_that_batch_ppo_learns_from():
    """The collectors' path: a ``RolloutBuffer`` packs the dicts it records; ``learn`` takes
    the rows and keeps statistics of the float parts only."""
    env = ImageAndFlag(size=36)
    space = env.observation_space
    algo = BatchPPO(space, env.action_space, 2, torso="nature_cnn", shared_torso=True,
                    rollout_length=6, minibatch_size=4, inference="eager")
    shape, dtype = stored_observations(space, torch.float32)
    assert (shape, dtype) == ((PackedObservations(space).size,), torch.uint8)
    buffer = RolloutBuffer(rollout_tensors(2, 6, shape, dtype, (), torch.int64,
                                           algo.behaviour_fields()), packing_for(space))
    buffer.start(torch.arange(2), version=0)
    frames = [map_nested(torch.as_tensor, stack_as(space, [env.reset(seed=2 * t + i)[0]
                                                            for i in range(2)]))
              for t in range(7)]
    for t in range(6):
        action, record = algo.act(frames[t])
        buffer.act(frames[t], action, record)
        done = torch.tensor([float(t == 2), 0.0])
        buffer.outcome(torch.ones(2), done, done, frames[t + 1])
    rollout = buffer.rollout()
    assert rollout.observ.dtype == torch.uint8 and rollout.observ.shape[-1] == shape[0]
    assert torch.equal(rollout.observ[:, 1], PackedObservations(space).pack_all(frames[1]))
    before = [p.detach().clone() for p in algo.policy.parameters()]
    summary = algo.learn(rollout)
    assert all(np.isfinite(value) for value in summary.values())
    assert any(not torch.equal(p, q) for p, q in zip(algo.policy.parameters(), before))
    assert algo.observ_normalizer.mean.shape == (2,)  # the flag's two values
    assert float(algo.observ_normalizer.count) == 12


@pytest.mark.slow
def test_impala_learns_from_dict_observations_through_a_collector(tmp_path):
    """IMPALA and a collector process on Dict observations: the image decides, the vector
    rides along (``flips=false``). The lag is bounded at one update: with these settings IMPALA
    can lose what it learned when the learner runs several updates ahead of the collector, as
    a loaded machine lets it."""
    logdir = tmp_path / "impala"
    assert train_main([
        "--config", "impala/cartpole", "--logdir", str(logdir), "--no-progress",
        "--set", "env.id=batchrl.testing.envs:image_and_flag",
        "--set", "env.kwargs={length=10, flips=false}", "--set", "env.eval_kwargs={length=20}",
        "--set", "env.max_length=20", "--set", "env.num_agents=8", "--set", "train.steps=6000",
        "--set", "train.eval_every=8", "--set", "train.collectors=1",
        "--set", "train.max_policy_lag=1",
        "--set", "algorithm.torso=nature_cnn", "--set", "algorithm.shared_torso=true",
        "--set", "algorithm.policy_layers=[]", "--set", "algorithm.value_layers=[]",
        "--set", "algorithm.rollout_length=16", "--set", "algorithm.learning_rate=1e-3",
        "--set", "algorithm.discount=0.9", "--set", "algorithm.lr_schedule=constant"]) == 0
    evals = [r for r in records(logdir) if r["phase"] == "eval"]
    assert evals[0]["score"] < 17.0 and evals[-1]["score"] >= 19.0, evals


# --- a vector env written in numpy as a batch member ---------------------------------------

def test_a_vector_envs_infos_stay_its_dict_of_arrays_until_read():
    from batchrl.envs.infos import InfoColumns, InfoList

    info = {"count": np.array([1.0, 2.0]), "_episode": np.array([False, True]),
            "episode": {"r": np.array([0.0, 2.0]), "_r": np.array([False, True])}}
    infos = InfoList([(2, InfoColumns(info))])
    info["count"][0] = 99.0  # (a vector env may reuse its arrays: the infos are a copy)
    columns = infos.columns()  # Gymnasium's layout: a mask for every key
    assert columns["count"].tolist() == [1.0, 2.0] and columns["_count"].tolist() == [True] * 2
    assert columns["_episode"].tolist() == [False, True]
    assert columns["episode"]["_r"].tolist() == [False, True]
    assert list(infos) == [{"count": 1.0}, {"count": 2.0, "episode": {"r": 2.0}}]
    joined = InfoList.join([InfoList([(2, InfoColumns({"count": np.array([1.0, 2.0])}))]),
                            InfoList([(1, InfoColumns({"count": np.array([3.0])}))])])
    assert joined.columns()["count"].tolist() == [1.0, 2.0, 3.0]
    assert list(joined) == [{"count": 1.0}, {"count": 2.0}, {"count": 3.0}]

class CountingVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` counters stepped at once (next-step autoreset, ``reset_mask``): each step
    adds the action to an env's count; episodes end after ``length`` steps with an ``episode``
    info (a dict of arrays, as ``RecordEpisodeStatistics`` gives)."""

    def __init__(self, num_envs: int, length: int = 3, max_episode_steps=None):
        self.num_envs, self.length = num_envs, length
        self.single_observation_space = gym.spaces.Box(0, 100, (1,), np.float32)
        self.single_action_space = gym.spaces.Discrete(3)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space,
                                                              num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.count = np.zeros(num_envs, np.float32)
        self.steps = np.zeros(num_envs, np.int64)
        self.pending = np.zeros(num_envs, bool)  # ended: reset by the next step

    def reset(self, *, seed=None, options=None):
        mask = (options or {}).get("reset_mask", np.ones(self.num_envs, bool))
        start = np.zeros(mask.sum(), np.float32) if seed is None else np.asarray(seed, np.float32)
        self.count[mask], self.steps[mask], self.pending[mask] = start, 0, False
        return self.count[:, None].copy(), {"count": self.count.copy()}

    def step(self, actions):
        fresh = self.pending.copy()
        self.count[fresh], self.steps[fresh] = 0.0, 0
        self.count[~fresh] += np.asarray(actions)[~fresh]
        self.steps[~fresh] += 1
        truncated = self.steps >= self.length
        self.pending = truncated.copy()
        reward = np.where(fresh, 0.0, 1.0)
        info = {"count": self.count.copy(), "episode": {"r": self.count.copy(), "_r": truncated},
                "_episode": truncated}
        return (self.count[:, None].copy(), reward, np.zeros(self.num_envs, bool), truncated,
                info)


class SentCountingVectorEnv(CountingVectorEnv):
    """``CountingVectorEnv`` with ``send``/``recv``: a member the batch steps in parallel."""

    def send(self, actions):
        self._result = self.step(actions)

    def recv(self):
        return self._result


@pytest.mark.parametrize("rejecting", [CountingVectorEnv, SentCountingVectorEnv],
                         ids=["stepped-here", "sent"])
def test_a_rejected_step_leaves_no_member_with_a_request_in_flight(rejecting):
    """One member rejects a step (an ended env not reset) after another was sent it (when it
    steps here, or as it is sent the step too): the error reaches the caller, the other
    member's answer is collected, and the batch steps on."""
    from batchrl.envs.vectorized import VectorWorker

    batch = BatchEnv([VectorWorker(lambda: SentCountingVectorEnv(2, length=5)),
                      VectorWorker(lambda: rejecting(2))])
    try:
        assert batch.workers  # (member 0 is sent its steps)
        batch.reset(seed=0)
        for _ in range(3):
            *_, truncated, _ = batch.step(np.ones(4, np.int64))
        assert truncated.tolist() == [False, False, True, True]
        with pytest.raises(ValueError, match="ended their episodes") as raised:
            batch.step(np.ones(4, np.int64))
        assert raised.value.__notes__ == [
            "(from the member holding envs 2-3 of the batch: env indices in the message count "
            "from 2)"]
        observ, *_ = batch.step(np.ones(4, np.int64), autoreset=truncated)
        assert observ[:, 0].tolist() == [5, 6, 0, 0]  # (the rejected step stepped member 0)
        batch.close()
        with pytest.raises(RuntimeError, match="step on a closed BatchEnv"):
            batch.step(np.ones(4, np.int64))
        with pytest.raises(RuntimeError, match="reset on a closed BatchEnv"):
            batch.reset()
    finally:
        batch.close()


class BrokenVectorEnv(CountingVectorEnv):
    def step(self, actions):
        raise RuntimeError("the simulator fell over")


def test_a_vector_env_that_raises_is_named_as_one():
    from batchrl.envs.errors import EnvRaisedError
    from batchrl.envs.vectorized import VectorWorker

    batch = BatchEnv([VectorWorker(lambda: CountingVectorEnv(2)),
                      VectorWorker(lambda: BrokenVectorEnv(3), label="broken")])
    try:
        batch.reset(seed=0)
        with pytest.raises(EnvRaisedError) as raised:
            batch.step(np.ones(5, np.int64))
        assert str(raised.value).startswith(
            "envs 2-4 (broken, one vector env in this process) failed in step(): RuntimeError: "
            "the simulator fell over")
    finally:
        batch.close()


def test_a_numpy_vector_env_is_a_batch_member():
    """``VectorWorker`` without ``send``/``recv`` steps in ``step_wait``; its infos (nested ones
    too) reach the batch, or nothing with ``infos=False`` (a restarted member too); an ended env
    must be reset."""
    from batchrl.envs.vectorized import VectorWorker

    member = VectorWorker(lambda: CountingVectorEnv(3))
    quiet = VectorWorker(lambda: CountingVectorEnv(2), infos=False)
    batch = BatchEnv([member, quiet])
    try:
        assert member.in_process and len(batch) == 5
        observ = batch.reset(seed=10)
        assert observ[:, 0].tolist() == [10, 11, 12, 13, 14]  # one seed per env reset
        for _ in range(3):
            observ, reward, terminated, truncated, infos = batch.step(np.full(5, 2))
        assert observ[:, 0].tolist() == [16, 17, 18, 19, 20] and truncated.all()
        assert infos[0] == {"count": 16.0, "episode": {"r": 16.0}} and infos[4] == {}
        with pytest.raises(ValueError, match=r"envs \[0, 1, 2\] ended their episodes"):
            batch.step(np.ones(5, np.int64))
        assert batch.reset([1], seed=[5])[:, 0].tolist() == [5]
        observ, reward, *_ = batch.step(np.ones(5, np.int64),
                                        autoreset=np.array([True, False, True, True, True]))
        assert observ[:, 0].tolist() == [0, 6, 0, 0, 0] and reward.tolist() == [0, 1, 0, 0, 0]
        restarted = quiet.restart()
        assert restarted.label == quiet.label and not restarted.infos
        restarted.close()
    finally:
        batch.close()


def test_a_vector_env_member_resets_envs_asked_in_any_order_each_with_its_seed():
    """The vector env takes one seed per env reset in the order of its envs (-1: ale-py's "no
    seed"); the rows and their infos come back in the order asked for (none with
    ``infos=False``)."""
    from batchrl.envs.vectorized import VectorWorker

    vector = CountingVectorEnv(4)  # (a reset sets an env's count to its seed)
    batch = BatchEnv([VectorWorker(lambda: vector),
                      VectorWorker(lambda: CountingVectorEnv(2), infos=False)])
    try:
        batch.reset(seed=0)
        rows, infos = batch.reset([3, 0, 2, 4], seed=[7, 9, None, 5], return_infos=True)
        assert rows[:, 0].tolist() == [7, 9, -1, 5]
        assert vector.count.tolist() == [9, 1, -1, 7]
        assert infos == [{"count": 7.0}, {"count": 9.0}, {"count": -1.0}, {}]
    finally:
        batch.close()


class SameStepCountingVectorEnv(CountingVectorEnv):
    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}


def test_a_vector_env_that_does_not_autoreset_at_the_next_step_is_refused():
    """(Its ended envs would start new episodes in the step that ended them: the batch's
    autoreset would reset them a second time.)"""
    from batchrl.envs.errors import EnvSpecError
    from batchrl.envs.vectorized import VectorWorker

    with pytest.raises(EnvSpecError, match=r"needs next-step autoreset .*SAME_STEP"):
        VectorWorker(lambda: SameStepCountingVectorEnv(2), label="same")


def test_with_floats_returns_new_rows_and_leaves_the_stored_ones_as_they_were():
    packing = PackedObservations(SPACE)
    batch = map_nested(torch.as_tensor, stack_as(SPACE, [SPACE.sample() for _ in range(4)]))
    packed = packing.pack_all(batch)
    before = packed.clone()
    halved = packing.with_floats(packed, packing.unpack(packed) / 2)
    assert torch.equal(packed, before)  # (an algorithm normalises rows its memory keeps)
    assert torch.equal(packing.unpack(halved), packing.unpack(before) / 2)


def test_observations_of_pixels_only_pack_into_their_bytes():
    space = gym.spaces.Dict({"left": gym.spaces.Box(0, 255, (2, 3), np.uint8),
                             "right": gym.spaces.Box(0, 255, (3,), np.uint8)})
    packing = PackedObservations(space)
    assert packing.float_size == 0 and packing.size == 12  # (9 bytes, padded)
    batch = map_nested(torch.as_tensor, stack_as(space, [space.sample() for _ in range(5)]))
    packed = packing.pack_all(batch)
    assert packed.shape == (5, 12) and packing.unpack(packed).shape == (5, 0)
    assert torch.equal(packed[:, :6], batch["left"].reshape(5, 6))
    assert torch.equal(packed[:, 6:9], batch["right"]) and not packed[:, 9:].any()


def test_rows_already_a_multiple_of_four_bytes_get_no_padding():
    space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (2, 4), np.uint8),
                             "x": gym.spaces.Box(-1, 1, (3,), np.float32)})
    assert PackedObservations(space).size == 3 * 4 + 8


def test_unsupported_space_errors_say_what_each_kind_may_be():
    """An observation may also be a Dict or Tuple of the batchable spaces; an action may not."""
    with pytest.raises(UnsupportedSpaceError,
                       match=r"^unsupported observation space Text\(.*\): a batch env needs one of "
                             r"Box, Discrete, MultiDiscrete, MultiBinary, or a Dict or Tuple of "
                             r"them$"):
        check_space("observation", gym.spaces.Text(8))
    with pytest.raises(UnsupportedSpaceError,
                       match=r"^unsupported action space Dict\('a': Discrete\(2\)\): a batch env "
                             r"needs one of Box, Discrete, MultiDiscrete, MultiBinary$"):
        check_space("action", gym.spaces.Dict({"a": gym.spaces.Discrete(2)}))
    check_space("observation", gym.spaces.Dict({"a": gym.spaces.MultiBinary(3)}))  # accepted


# --- dict key order, image-only dicts, mixed parts, empty resets ------------------------------

def reordered(value: dict) -> dict:
    """The same dict with its keys in reverse order (as an env may build it)."""
    return {key: value[key] for key in reversed(list(value))}


def test_map_nested_matches_dicts_by_key_and_leaves_follow_the_space():
    SPACE.seed(0)
    rows = [SPACE.sample() for _ in range(3)]
    batch = stack_as(SPACE, rows)
    # The leaves come in leaf_spaces' order, tuple parts included.
    assert [leaf.shape for leaf in leaves(batch)] == [
        (3, *space.shape) for _, space in leaf_spaces(SPACE)]
    # A second value with its keys in another order is matched key by key.
    same = map_nested(lambda a, b: a.shape == b.shape and np.array_equal(a, b),
                      batch, reordered(batch))
    assert list(same) == ["camera", "depth", "joints"] and all(leaves(same))
    # unstack gives every row back.
    back = unstack(batch)
    assert len(back) == 3
    for got, want in zip(back, rows):
        for a, b in zip(leaves(got), leaves(stack_as(SPACE, [want]))):
            np.testing.assert_array_equal(a, b[0])


def test_packing_takes_a_dict_in_any_key_order():
    SPACE.seed(1)
    packing = PackedObservations(SPACE)
    batch = map_nested(torch.as_tensor, stack_as(SPACE, [SPACE.sample() for _ in range(4)]))
    floats = packing.floats(reordered(batch), torch.device("cpu"))
    assert floats.dtype == torch.float32 and floats.shape == (4, packing.float_size)
    assert torch.equal(floats, packing.floats(batch, torch.device("cpu")))
    assert torch.equal(packing.pack_all(reordered(batch)), packing.pack_all(batch))


class TwoCameras(gym.Env):
    """A Dict observation of two uint8 images and nothing else."""

    observation_space = gym.spaces.Dict({"left": gym.spaces.Box(0, 255, (2, 3), np.uint8),
                                         "right": gym.spaces.Box(0, 255, (5,), np.uint8)})
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


def test_a_dict_of_images_only_packs_every_row():
    with BatchEnv([TwoCameras() for _ in range(3)]) as env:
        observ = env.reset(seed=0)
    packing = PackedObservations(TwoCameras.observation_space)
    assert packing.float_size == 0 and packing.size == 12  # 6 + 5 bytes, padded
    packed = packing.pack_all(observ)
    assert packed.shape == (3, 12) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, :6], torch.as_tensor(observ["left"]).reshape(3, 6))
    assert torch.equal(packed[:, 6:11], torch.as_tensor(observ["right"]))


def test_batch_ppo_rejects_a_dict_with_one_part_it_cannot_take():
    mixed = gym.spaces.Dict({"x": gym.spaces.Box(-1, 1, (3,), np.float32),
                             "bits": gym.spaces.MultiBinary(3)})
    with pytest.raises(UnsupportedSpaceError, match=r"a Dict or Tuple of Box and Discrete"):
        BatchPPO(mixed, gym.spaces.Discrete(2), 2)


def test_tensor_batch_env_resets_no_rows_of_a_dict():
    env = TensorBatchEnv(BatchEnv([EnvWorker([lambda: ImageAndFlag(size=8)] * 2)]))
    try:
        env.reset(seed=0)
        empty = env.reset(torch.tensor([], dtype=torch.int64))
        assert list(empty) == ["flag", "image"]
        assert empty["image"].shape == (0, 1, 8, 8) and empty["image"].dtype == torch.uint8
        assert empty["flag"].shape == (0, 2) and empty["flag"].dtype == torch.float32
    finally:
        env.close()


def test_the_floats_of_discrete_parts_alone_are_float32():
    """A Discrete part is an int64 leaf: ``floats`` casts it, so an observation whose only
    non-pixel part is Discrete still gives float32 values (an int64 batch would come back
    from the observation normaliser int64, its normalised values truncated)."""
    space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (2, 2), np.uint8),
                             "room": gym.spaces.Discrete(5)})
    space.seed(2)
    packing = PackedObservations(space)
    batch = map_nested(torch.as_tensor, stack_as(space, [space.sample() for _ in range(3)]))
    floats = packing.floats(batch, torch.device("cpu"))
    assert floats.dtype == torch.float32 and floats.shape == (3, 1)
    assert floats[:, 0].tolist() == batch["room"].float().tolist()
    assert torch.equal(packing.unpack(packing.pack(batch, floats)), floats)
