"""Returns, advantages, the streaming normaliser and the episode memory, against
hand-computed numbers and plain numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchrl.parts import (EpisodeMemory, RolloutMemory, StreamingNormalizer, discounted_cumsum,
                           discounted_return, gae, generalized_advantage, numpy_views)
from batchrl.parts.normalize import Statistics


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def lengths(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# -- numpy references ---------------------------------------------------------------


def np_discounted_return(reward, length, gamma, bootstrap=None):
    """R_t = r_t + gamma * R_{t+1}, R_L = bootstrap; zero on padded steps."""
    result = np.zeros_like(reward, dtype=np.float64)
    for e, steps in enumerate(length):
        running = 0.0 if bootstrap is None else float(bootstrap[e])
        for t in reversed(range(steps)):
            running = reward[e, t] + gamma * running
            result[e, t] = running
    return result


def np_gae(reward, value, length, gamma, lam, bootstrap=None):
    """A_t = delta_t + gamma * lam * A_{t+1}, delta_t = r_t + gamma V_{t+1} - V_t."""
    result = np.zeros_like(reward, dtype=np.float64)
    for e, steps in enumerate(length):
        advantage = 0.0
        next_value = 0.0 if bootstrap is None else float(bootstrap[e])
        for t in reversed(range(steps)):
            delta = reward[e, t] + gamma * next_value - value[e, t]
            advantage = delta + gamma * lam * advantage
            result[e, t] = advantage
            next_value = value[e, t]
    return result


# -- discounted_return ------------------------------------------------------------------


def test_discounted_return_by_hand():
    reward = t64([[1.0, 2.0, 3.0]])
    # R2 = 3, R1 = 2 + 0.5 * 3, R0 = 1 + 0.5 * 3.5
    result = discounted_return(reward, lengths(3), 0.5)
    assert result.tolist() == [[2.75, 3.5, 3.0]]
    # Bootstrap 4 after the last step: R2 = 3 + 0.5 * 4 = 5, R1 = 4.5, R0 = 3.25.
    result = discounted_return(reward, lengths(3), 0.5, bootstrap=t64([4.0]))
    assert result.tolist() == [[3.25, 4.5, 5.0]]


def test_discounted_return_padding_by_hand():
    # Episode 0 has 3 steps, episode 1 two steps (then junk), episode 2 none.
    reward = t64([[1.0, 2.0, 3.0],
                  [4.0, 8.0, 100.0],
                  [7.0, 7.0, 7.0]])
    length = lengths(3, 2, 0)
    result = discounted_return(reward, length, 0.5)
    assert result.tolist() == [[2.75, 3.5, 3.0],
                               [8.0, 8.0, 0.0],
                               [0.0, 0.0, 0.0]]
    # The bootstrap enters at each episode's own last step, never at padding,
    # and an empty episode stays zero whatever its bootstrap.
    result = discounted_return(reward, length, 0.5, bootstrap=t64([4.0, 2.0, 9.0]))
    assert result.tolist() == [[3.25, 4.5, 5.0],
                               [8.5, 9.0, 0.0],
                               [0.0, 0.0, 0.0]]


def test_discounted_return_ignores_nonfinite_padding():
    reward = t64([[1.0, 2.0, float("nan")], [4.0, float("inf"), -float("inf")]])
    result = discounted_return(reward, lengths(2, 1), 0.5, bootstrap=t64([2.0, 6.0]))
    # Episode 0: R1 = 2 + 0.5 * 2 = 3, R0 = 1 + 1.5 = 2.5. Episode 1: R0 = 4 + 3 = 7.
    assert result.tolist() == [[2.5, 3.0, 0.0], [7.0, 0.0, 0.0]]


def test_discounted_return_keeps_dtype():
    reward = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float32)
    result = discounted_return(reward, lengths(3), 0.5, torch.tensor([4.0]))
    assert result.dtype == torch.float32
    assert result.tolist() == [[3.25, 4.5, 5.0]]


@pytest.mark.parametrize("with_bootstrap", [False, True])
def test_discounted_return_matches_numpy_loop(with_bootstrap):
    rng = np.random.default_rng(0)
    episodes, steps = 7, 50
    length = np.array([50, 1, 0, 17, 49, 33, 2])
    reward = rng.normal(size=(episodes, steps))
    bootstrap = rng.normal(size=episodes) if with_bootstrap else None
    expected = np_discounted_return(reward, length, 0.99, bootstrap)
    result = discounted_return(torch.from_numpy(reward), torch.from_numpy(length), 0.99,
                               None if bootstrap is None else torch.from_numpy(bootstrap))
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-10, atol=1e-10)
    # Garbage in the padding must not change anything.
    noisy = reward.copy()
    noisy[np.arange(steps)[None] >= length[:, None]] = 1e6
    result = discounted_return(torch.from_numpy(noisy), torch.from_numpy(length), 0.99,
                               None if bootstrap is None else torch.from_numpy(bootstrap))
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-10, atol=1e-10)


# -- generalized_advantage -----------------------------------------------------------


def test_generalized_advantage_by_hand():
    reward = t64([[1.0, 2.0, 3.0]])
    value = t64([[0.5, 1.0, 1.5]])
    # gamma = lambda = 0.5, bootstrap 2:
    # delta = [1 + 0.5 - 0.5, 2 + 0.75 - 1, 3 + 1 - 1.5] = [1, 1.75, 2.5]
    # A2 = 2.5, A1 = 1.75 + 0.25 * 2.5 = 2.375, A0 = 1 + 0.25 * 2.375 = 1.59375
    result = generalized_advantage(reward, value, lengths(3), 0.5, 0.5, t64([2.0]))
    assert result.tolist() == [[1.59375, 2.375, 2.5]]
    # Without bootstrap delta2 = 3 - 1.5 = 1.5: A = [1.53125, 2.125, 1.5].
    result = generalized_advantage(reward, value, lengths(3), 0.5, 0.5)
    assert result.tolist() == [[1.53125, 2.125, 1.5]]


def test_generalized_advantage_padding_by_hand():
    reward = t64([[1.0, 2.0, 3.0], [4.0, 8.0, 100.0]])
    value = t64([[0.5, 1.0, 1.5], [1.0, 2.0, 50.0]])
    # Episode 1 ends after two steps: its last next-value is the bootstrap
    # (zero here), not value[2] = 50. delta = [4 + 1 - 1, 8 + 0 - 2] = [4, 6],
    # A1 = 6, A0 = 4 + 0.25 * 6 = 5.5.
    result = generalized_advantage(reward, value, lengths(3, 2), 0.5, 0.5,
                                   bootstrap=t64([2.0, 0.0]))
    assert result.tolist() == [[1.59375, 2.375, 2.5], [5.5, 6.0, 0.0]]
    # Bootstrap 4 for episode 1: delta1 = 8 + 2 - 2 = 8, A0 = 4 + 2 = 6.
    result = generalized_advantage(reward, value, lengths(3, 2), 0.5, 0.5,
                                   bootstrap=t64([2.0, 4.0]))
    assert result.tolist() == [[1.59375, 2.375, 2.5], [6.0, 8.0, 0.0]]
    # Non-finite padding in rewards and values does not leak.
    reward[1, 2] = float("nan")
    value[1, 2] = float("inf")
    result = generalized_advantage(reward, value, lengths(3, 2), 0.5, 0.5,
                                   bootstrap=t64([2.0, 4.0]))
    assert result.tolist() == [[1.59375, 2.375, 2.5], [6.0, 8.0, 0.0]]


@pytest.mark.parametrize("with_bootstrap", [False, True])
def test_generalized_advantage_matches_numpy_loop(with_bootstrap):
    rng = np.random.default_rng(1)
    episodes, steps = 7, 50
    length = np.array([50, 1, 0, 17, 49, 33, 2])
    reward = rng.normal(size=(episodes, steps))
    value = rng.normal(size=(episodes, steps))
    bootstrap = rng.normal(size=episodes) if with_bootstrap else None
    expected = np_gae(reward, value, length, 0.99, 0.95, bootstrap)
    pad = np.arange(steps)[None] >= length[:, None]
    reward[pad], value[pad] = 1e6, -1e6  # must be ignored
    result = generalized_advantage(
        torch.from_numpy(reward), torch.from_numpy(value), torch.from_numpy(length), 0.99, 0.95,
        None if bootstrap is None else torch.from_numpy(bootstrap))
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-10, atol=1e-10)


def test_generalized_advantage_with_lambda_one_is_return_minus_value():
    rng = np.random.default_rng(2)
    reward, value = rng.normal(size=(4, 20)), rng.normal(size=(4, 20))
    length, bootstrap = torch.tensor([20, 5, 11, 1]), torch.from_numpy(rng.normal(size=4))
    reward_t, value_t = torch.from_numpy(reward), torch.from_numpy(value)
    advantage = generalized_advantage(reward_t, value_t, length, 0.9, 1.0, bootstrap)
    returns = discounted_return(reward_t, length, 0.9, bootstrap)
    valid = torch.arange(20)[None] < length[:, None]
    expected = torch.where(valid, returns - value_t, torch.zeros(()))
    torch.testing.assert_close(advantage, expected, rtol=1e-10, atol=1e-10)


# -- discounted_cumsum and gae (rollouts with per-step ends) ---------------------------


def np_rollout_gae(reward, value, next_value, ends, gamma, lam):
    """The backward loop over time that gae vectorises."""
    result = np.zeros_like(reward, dtype=np.float64)
    advantage = np.zeros(reward.shape[0])
    for t in reversed(range(reward.shape[1])):
        delta = reward[:, t] + gamma * next_value[:, t] - value[:, t]
        advantage = delta + gamma * lam * (1.0 - ends[:, t]) * advantage
        result[:, t] = advantage
    return result


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 8, 64, 1000])
def test_discounted_cumsum_matches_the_loop(steps):
    rng = np.random.default_rng(steps)
    values = rng.normal(size=(5, steps))
    factors = rng.uniform(0.0, 1.0, size=(5, steps)) * (rng.uniform(size=(5, steps)) > 0.1)
    expected = np.zeros_like(values)
    running = np.zeros(5)
    for t in reversed(range(steps)):
        running = values[:, t] + factors[:, t] * running
        expected[:, t] = running
    result = discounted_cumsum(torch.from_numpy(values), torch.from_numpy(factors))
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-10, atol=1e-12)
    # float32 in, float32 out, computed in float64: the float64 result of the same inputs
    # rounded once
    floats = torch.from_numpy(values).float()
    result = discounted_cumsum(floats, torch.from_numpy(factors))
    assert result.dtype == torch.float32
    assert torch.equal(result, discounted_cumsum(floats.double(),
                                                 torch.from_numpy(factors)).float())


def test_gae_at_episode_ends_and_the_rollout_cut_by_hand():
    # One agent, 4 steps, gamma = lambda = 0.5. Its episode terminates at step
    # 1 (next value 0); a new one starts at step 2 and is cut by the end of the
    # rollout after step 3, where it bootstraps from the value 8 of the state
    # after it.
    reward = t64([[1.0, 2.0, 3.0, 4.0]])
    value = t64([[2.0, 4.0, 2.0, 4.0]])
    next_value = t64([[4.0, 0.0, 4.0, 8.0]])
    ends = torch.tensor([[False, True, False, True]])
    # delta = [1 + 2 - 2, 2 + 0 - 4, 3 + 2 - 2, 4 + 4 - 4] = [1, -2, 3, 4]
    # A3 = 4, A2 = 3 + 0.25 * 4 = 4, A1 = -2 (an end), A0 = 1 + 0.25 * -2 = 0.5
    result = gae(reward, value, next_value, ends, 0.5, 0.5)
    assert result.tolist() == [[0.5, -2.0, 4.0, 4.0]]
    # A time limit at step 1 instead of a terminal state: the next value is the
    # value of the real final observation, say 6: delta1 = 2 + 3 - 4 = 1.
    next_value[0, 1] = 6.0
    assert gae(reward, value, next_value, ends, 0.5, 0.5).tolist() == [[1.25, 1.0, 4.0, 4.0]]


def test_gae_matches_the_loop_and_lambda_one_gives_returns():
    rng = np.random.default_rng(3)
    agents, steps = 6, 37
    reward, value = rng.normal(size=(agents, steps)), rng.normal(size=(agents, steps))
    next_value = rng.normal(size=(agents, steps))
    ends = rng.uniform(size=(agents, steps)) < 0.1
    ends[:, -1] = True
    expected = np_rollout_gae(reward, value, next_value, ends, 0.99, 0.95)
    result = gae(*map(torch.from_numpy, (reward, value, next_value, ends)), 0.99, 0.95)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-10, atol=1e-10)
    # lambda = 1: the advantage plus the value is the discounted return,
    # bootstrapped from next_value at every end (inside a segment the next
    # value is the next step's).
    next_value[:, :-1] = np.where(ends[:, :-1], next_value[:, :-1], value[:, 1:])
    returns = np.zeros_like(reward)
    running = np.zeros(agents)
    for t in reversed(range(steps)):
        running = reward[:, t] + 0.99 * np.where(ends[:, t], next_value[:, t], running)
        returns[:, t] = running
    result = gae(*map(torch.from_numpy, (reward, value, next_value, ends)), 0.99, 1.0)
    np.testing.assert_allclose(result.numpy() + value, returns, rtol=1e-10, atol=1e-10)


# -- StreamingNormalizer ------------------------------------------------------------


@pytest.fixture(params=[0, 5], ids=["merge-each", "defer-5"])
def defer(request) -> int:
    """The normaliser's ``defer``: each test runs with batches merged at once
    and with up to 5 values held back (batches larger than that are merged
    directly), so every read must see the held values."""
    return request.param


def test_normalizer_statistics_match_numpy(host_path, defer):
    rng = np.random.default_rng(3)
    normalizer = StreamingNormalizer((4,), center=True, scale=True, clip=None, defer=defer)
    seen = []
    for size in (1, 7, 2, 30, 0, 5):
        batch = rng.normal(loc=[1.0, -3.0, 10.0, 0.0], scale=[1.0, 0.1, 5.0, 2.0], size=(size, 4))
        normalizer.update(torch.from_numpy(batch).float())
        seen.append(batch.astype(np.float32))
    data = np.concatenate(seen).astype(np.float64)
    assert float(normalizer.count) == 45
    np.testing.assert_allclose(normalizer.mean.numpy(), data.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(normalizer.variance.numpy(), data.var(0, ddof=1),
                               rtol=1e-10)
    values = rng.normal(size=(3, 4)).astype(np.float32)
    expected = (values - data.mean(0)) / (data.std(0, ddof=1) + 1e-8)
    result = normalizer.transform(torch.from_numpy(values))
    assert result.dtype == torch.float32
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_normalizer_variance_is_one_before_two_values(host_path, defer):
    normalizer = StreamingNormalizer((2,), defer=defer)
    assert normalizer.variance.tolist() == [1.0, 1.0]
    normalizer.update(torch.tensor([[3.0, -1.0]]))
    assert normalizer.variance.tolist() == [1.0, 1.0]
    assert normalizer.mean.tolist() == [3.0, -1.0]
    # Centred only: [5, 5] - [3, -1], scaled by 1 / (1 + eps).
    np.testing.assert_allclose(normalizer.transform(torch.tensor([[5.0, 5.0]])).numpy(),
                               [[2.0, 6.0]], rtol=1e-6)


def test_normalizer_transform_center_scale_clip(host_path, defer):
    normalizer = StreamingNormalizer((2,), center=True, scale=True, clip=1.5, defer=defer)
    normalizer.update(torch.tensor([[0.0, 10.0], [2.0, 10.0], [4.0, 16.0]]))
    # mean [2, 12], var (ddof=1) [4, 12] -> std [2, sqrt(12)]
    np.testing.assert_allclose(normalizer.variance.numpy(), [4.0, 12.0])
    values = torch.tensor([[3.0, 12.0], [100.0, -100.0], [1.0, 12.0 + np.sqrt(12.0)]])
    result = normalizer.transform(values)
    np.testing.assert_allclose(result.numpy(), [[0.5, 0.0], [1.5, -1.5], [-0.5, 1.0]],
                               rtol=1e-6, atol=1e-6)
    # Scale only / centre only / neither.
    normalizer.center = False
    np.testing.assert_allclose(normalizer.transform(torch.tensor([[1.0, 0.0]])).numpy(),
                               [[0.5, 0.0]], rtol=1e-6)
    normalizer.center, normalizer.scale, normalizer.clip = True, False, None
    np.testing.assert_allclose(normalizer.transform(torch.tensor([[1.0, 0.0]])).numpy(),
                               [[-1.0, -12.0]])
    normalizer.center = False
    assert normalizer.transform(torch.tensor([[7.0, -9.0]])).tolist() == [[7.0, -9.0]]


def test_reward_style_normalizer(host_path, defer):
    rng = np.random.default_rng(4)
    normalizer = StreamingNormalizer((), center=False, scale=True, clip=10.0, defer=defer)
    rewards = [rng.normal(loc=5.0, scale=0.5, size=size) for size in (3, 8, 1, 20)]
    for batch in rewards:
        normalizer.update(torch.from_numpy(batch).float())
    data = np.concatenate(rewards).astype(np.float32).astype(np.float64)
    assert normalizer.mean.shape == ()
    np.testing.assert_allclose(float(normalizer.mean), data.mean(), rtol=1e-10)
    np.testing.assert_allclose(float(normalizer.variance), data.var(ddof=1), rtol=1e-8)
    std = data.std(ddof=1)
    values = torch.tensor([5.0, -1.0, 0.0, 1000.0, -1000.0])
    expected = np.clip(values.numpy() / (std + 1e-8), -10.0, 10.0)  # not centred
    result = normalizer.transform(values)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)
    assert result[3] == 10.0 and result[4] == -10.0
    # Episode-shaped rewards (E, T) transform elementwise.
    grid = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    np.testing.assert_allclose(normalizer.transform(grid).numpy(), grid.numpy() / (std + 1e-8),
                               rtol=1e-6)


@pytest.mark.parametrize("center,scale", [(True, True), (True, False), (False, True)])
def test_normalizer_transform_follows_every_update(host_path, defer, center, scale):
    """The derived float32 statistics are renewed (on the CPU: rewritten in
    place) after each update; results already returned keep their values."""
    normalizer = StreamingNormalizer((2,), center=center, scale=scale, clip=None, defer=defer)
    probe = torch.tensor([[1.0, 2.0], [-3.0, 0.5]])
    seen, results = [], []
    for batch in ([[0.0, 0.0], [2.0, 4.0]], [[10.0, -10.0]], [[1.0, 1.0], [5.0, 3.0], [0.0, 7.0]]):
        normalizer.update(torch.tensor(batch))
        seen += batch
        data = np.array(seen)
        expected = probe.numpy().astype(np.float64)
        if center:
            expected = expected - data.mean(0)
        if scale:
            expected = expected / (data.std(0, ddof=1) + 1e-8)
        result = normalizer.transform(probe)
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-6)
        results.append((result, result.clone()))
    for result, copy in results:
        assert torch.equal(result, copy)


def test_normalizer_state_dict_round_trip(host_path, defer):
    rng = np.random.default_rng(5)
    source = StreamingNormalizer((3,), center=True, scale=True, clip=5.0, defer=defer)
    for size in (4, 9):
        source.update(torch.from_numpy(rng.normal(size=(size, 3))).float())
    target = StreamingNormalizer((3,), center=True, scale=True, clip=5.0, defer=defer)
    target.load_state_dict(source.state_dict())
    assert set(source.state_dict()) == {"count", "mean", "sum_sq"}
    for name in ("count", "mean", "sum_sq"):
        assert torch.equal(getattr(source, name), getattr(target, name))
        assert getattr(target, name).dtype == torch.float64
    values = torch.from_numpy(rng.normal(size=(6, 3))).float()
    assert torch.equal(source.transform(values), target.transform(values))
    # Both continue identically.
    more = torch.from_numpy(rng.normal(size=(5, 3))).float()
    source.update(more)
    target.update(more)
    assert torch.equal(source.transform(values), target.transform(values))
    assert float(target.count) == 18


def test_numpy_views_share_the_memory_and_are_none_where_numpy_cannot_or_must_not_read(
        monkeypatch):
    tensor = torch.zeros(3)
    numpy_views.view(tensor)[1] = 5.0
    assert tensor.tolist() == [0.0, 5.0, 0.0]
    weights = torch.ones(2, requires_grad=True)
    assert numpy_views.view(weights).tolist() == [1.0, 1.0]  # (read through detach())
    assert numpy_views.view(torch.zeros(2, dtype=torch.bfloat16)) is None
    assert numpy_views.view(torch.zeros(2, dtype=torch.complex64).conj()) is None
    # Disabled, every tensor takes the torch path (the host_path fixture's "torch" runs).
    monkeypatch.setattr(numpy_views, "enabled", False)
    assert numpy_views.view(tensor) is None


def test_normalizer_numpy_and_torch_paths_agree(monkeypatch):
    rng = np.random.default_rng(6)
    batches = [torch.from_numpy(rng.normal(3.0, 2.0, size=(size, 5))).float()
               for size in (1, 8, 3, 32, 8)]
    probe = torch.from_numpy(rng.normal(3.0, 8.0, size=(4, 5))).float()
    results = {}
    for numpy_path in (True, False):
        monkeypatch.setattr(numpy_views, "enabled", numpy_path)
        normalizer = StreamingNormalizer((5,), center=True, scale=True, clip=2.0)
        outputs = []
        for batch in batches:
            normalizer.update(batch)
            outputs.append(normalizer.transform(probe))
        results[numpy_path] = (normalizer.state_dict(), outputs)
    for name, value in results[True][0].items():
        torch.testing.assert_close(value, results[False][0][name], rtol=1e-13, atol=1e-13)
    for numpy_out, torch_out in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(numpy_out, torch_out, rtol=1e-6, atol=1e-6)
    assert any((out.abs() == 2.0).any() for out in results[True][1])  # clipping was exercised


def test_normalizer_values_that_require_grad_or_are_float64(host_path, defer):
    normalizer = StreamingNormalizer((2,), center=True, scale=True, defer=defer)
    normalizer.update(torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    leaf = torch.tensor([[1.0, 2.0]], requires_grad=True)
    result = normalizer.transform(leaf)
    assert result.requires_grad
    expected = (torch.tensor([[1.0, 2.0]]) - torch.tensor([1.0, 2.0])) / np.sqrt(2.0)
    torch.testing.assert_close(result.detach(), expected)
    double = normalizer.transform(torch.tensor([[1.0, 2.0]], dtype=torch.float64))
    assert double.dtype == torch.float64
    torch.testing.assert_close(double.float(), expected)
    normalizer.update(leaf)
    assert float(normalizer.count) == 3
    torch.testing.assert_close(normalizer.mean, t64([1.0, 2.0]))


def test_normalizer_copies_and_loads_keep_their_own_statistics(defer):
    import copy
    import pickle
    source = StreamingNormalizer((2,), center=True, scale=False, defer=defer)
    source.update(torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    source.transform(torch.zeros(1, 2))  # derive, and make the numpy views
    for clone in (copy.deepcopy(source), pickle.loads(pickle.dumps(source))):
        clone.update(torch.tensor([[20.0, 20.0]]))
        assert source.mean.tolist() == [2.0, 2.0]  # the original is untouched
        assert clone.mean.tolist() == [8.0, 8.0]
        assert clone.transform(torch.tensor([[8.0, 9.0]])).tolist() == [[0.0, 1.0]]
    target = StreamingNormalizer((2,), center=True, scale=False, defer=defer)
    target.transform(torch.zeros(1, 2))
    target.load_state_dict(source.state_dict(), assign=True)
    target.update(torch.tensor([[5.0, 5.0]]))
    assert target.mean.tolist() == [3.0, 3.0] and float(target.count) == 3
    assert target.transform(torch.tensor([[3.0, 4.0]])).tolist() == [[0.0, 1.0]]


def test_normalizer_defer_holds_values_until_the_statistics_are_read(host_path):
    import copy
    import pickle
    rng = np.random.default_rng(7)
    deferred = StreamingNormalizer((3,), defer=10)
    at_once = StreamingNormalizer((3,))

    def feed(size):
        batch = torch.from_numpy(rng.normal(2.0, 3.0, size=(size, 3))).float()
        deferred.update(batch)
        at_once.update(batch)

    def assert_same(normalizer):
        for name in ("count", "mean", "sum_sq"):
            torch.testing.assert_close(getattr(normalizer, name), getattr(at_once, name),
                                       rtol=1e-12, atol=1e-12)

    feed(4)
    feed(4)
    assert deferred._buffers["count"].item() == 0  # both batches are held
    # Copies, moves and state dicts take the held values with them.
    for clone in (copy.deepcopy(deferred), pickle.loads(pickle.dumps(deferred))):
        assert_same(clone)
    feed(4)  # no room: the 8 held values are merged, these 4 held
    assert deferred._buffers["count"].item() == 8
    state = {name: value.clone() for name, value in deferred.state_dict().items()}
    assert state["count"].item() == 12
    feed(3)
    deferred.to("cpu")
    assert deferred._buffers["count"].item() == 15
    feed(11)  # more than defer: merged at once
    assert deferred._buffers["count"].item() == 26
    feed(2)
    assert_same(deferred)  # reading a buffer merges first
    probe = torch.from_numpy(rng.normal(size=(5, 3))).float()
    feed(2)
    torch.testing.assert_close(deferred.transform(probe), at_once.transform(probe))
    feed(2)
    torch.testing.assert_close(deferred.variance, at_once.variance, rtol=1e-12, atol=0)
    # Loading replaces the statistics: held values are dropped, not merged.
    feed(2)
    deferred.load_state_dict(state)
    assert deferred._buffers["count"].item() == 12
    for name, value in state.items():
        assert torch.equal(getattr(deferred, name), value)
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="defer must be a whole number of values >= 0"):
            StreamingNormalizer((3,), defer=bad)


# -- EpisodeMemory ---------------------------------------------------------------------


def make_memory(num_agents=3, capacity=2, max_length=4):
    return EpisodeMemory(num_agents, capacity, max_length,
                         step_fields={"x": ((), torch.float32), "a": ((2,), torch.int64)},
                         episode_fields={"last": ((), torch.float32)})


def test_memory_append_finish_and_data(host_path):
    memory = make_memory()
    all_agents = torch.arange(3)
    for step in range(3):
        agents = all_agents if step < 2 else torch.tensor([0, 2])
        memory.append(agents, x=agents.float() * 10 + step,
                      a=torch.stack([agents, agents + step], 1))
    memory.set_episode(torch.tensor([2]), last=torch.tensor([7.0]))
    assert memory.finish(torch.tensor([2, 1])) == 2
    assert memory.full
    data, length = memory.data()
    assert length.tolist() == [3, 2]
    assert data["x"][0, :3].tolist() == [20.0, 21.0, 22.0]
    assert data["x"][1, :2].tolist() == [10.0, 11.0]
    assert data["a"][0, :3].tolist() == [[2, 2], [2, 3], [2, 4]]
    assert data["last"].tolist() == [7.0, 0.0]
    # Finished agents restart at step 0; agent 0 keeps running.
    assert memory.running_length.tolist() == [3, 0, 0]
    # No room left: extra episodes are dropped, but their running buffers reset.
    assert memory.finish(torch.tensor([0])) == 0
    assert memory.running_length.tolist() == [0, 0, 0]
    assert memory.data()[1].tolist() == [3, 2]
    memory.clear()
    assert not memory.full and memory.data()[1].numel() == 0


def test_memory_discard_and_errors(host_path):
    memory = make_memory(max_length=2)
    agents = torch.arange(3)
    memory.append(agents, x=torch.ones(3), a=torch.zeros(3, 2, dtype=torch.int64))
    memory.discard(torch.tensor([1]))
    assert memory.running_length.tolist() == [1, 0, 1]
    with pytest.raises(KeyError):
        memory.append(agents, x=torch.ones(3))
    with pytest.raises(KeyError):
        memory.set_episode(agents, nope=torch.ones(3))
    # A value of the wrong shape is an error, even where it would broadcast.
    with pytest.raises(ValueError, match=r"'a' must have shape \(3, 2\), got \(2,\)"):
        memory.append(agents, x=torch.ones(3), a=torch.zeros(2, dtype=torch.int64))
    assert memory.running_length.tolist() == [1, 0, 1]
    memory.append(agents, x=torch.ones(3), a=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="max_length"):
        memory.append(agents, x=torch.ones(3), a=torch.zeros(3, 2, dtype=torch.int64))


def test_memory_state_dict_round_trip(host_path):
    memory = make_memory()
    agents = torch.arange(3)
    memory.append(agents, x=torch.tensor([1.0, 2.0, 3.0]),
                  a=torch.arange(6).reshape(3, 2))
    memory.finish(torch.tensor([1]))
    memory.append(agents, x=torch.tensor([4.0, 5.0, 6.0]), a=torch.zeros(3, 2, dtype=torch.int64))
    other = make_memory()
    other.load_state_dict(memory.state_dict())
    assert other.count == 1
    assert other.running_length.tolist() == [2, 1, 2]
    for name in ("x", "a", "last"):
        assert torch.equal(other.running[name], memory.running[name])
        assert torch.equal(other.stored[name], memory.stored[name])
    assert torch.equal(other.stored_length, memory.stored_length)


def test_memory_length_check_looks_only_at_the_agents_appended(host_path):
    memory = make_memory(max_length=2)

    def append(agents):
        agents = torch.tensor(agents)
        memory.append(agents, x=torch.ones(len(agents)),
                      a=torch.zeros(len(agents), 2, dtype=torch.int64))

    append([0, 1, 2])
    append([0])  # agent 0's episode is full now
    append([1, 2])  # the others still have room
    with pytest.raises(RuntimeError, match="max_length=2"):
        append([2])
    memory.finish(torch.arange(3))
    append([0, 1, 2])
    append([0, 1, 2])
    assert memory.running_length.tolist() == [2, 2, 2]


def test_memory_paths_store_the_same_and_never_a_graph(monkeypatch):
    """The numpy and torch paths store the same; a value that requires grad
    is stored as data: the buffers never join a graph."""
    memories = {}
    for numpy_path in (True, False):
        monkeypatch.setattr(numpy_views, "enabled", numpy_path)
        memory = make_memory()
        agents = torch.tensor([2, 0])
        memory.append(agents, x=torch.tensor([1.5, 2.5]), a=torch.tensor([[1, 2], [3, 4]]))
        memory.append(agents, x=torch.tensor([3.5, 4.5], requires_grad=True),
                      a=torch.tensor([[5, 6], [7, 8]]))
        memory.append(torch.tensor([1]), x=torch.tensor([9.0]), a=torch.tensor([[9, 9]]))
        assert not memory.running["x"].requires_grad
        memories[numpy_path] = memory
    numpy_memory, torch_memory = memories[True], memories[False]
    assert numpy_memory.running_length.tolist() == [2, 1, 2]
    assert numpy_memory.running["x"][2, :2].tolist() == [1.5, 3.5]
    assert numpy_memory.running["a"][0, :2].tolist() == [[3, 4], [7, 8]]
    for name in ("x", "a"):
        assert torch.equal(numpy_memory.running[name], torch_memory.running[name])
    assert torch.equal(numpy_memory.running_length, torch_memory.running_length)


def test_memory_copies_write_their_own_buffers():
    import copy
    import pickle
    memory = make_memory()
    agents = torch.arange(3)
    memory.append(agents, x=torch.ones(3), a=torch.zeros(3, 2, dtype=torch.int64))
    for clone in (copy.deepcopy(memory), pickle.loads(pickle.dumps(memory))):
        clone.append(agents, x=torch.full((3,), 2.0), a=torch.ones(3, 2, dtype=torch.int64))
        assert clone.running["x"][:, :2].tolist() == [[1.0, 2.0]] * 3
        assert clone.running_length.tolist() == [2, 2, 2]
    assert memory.running["x"][:, :2].tolist() == [[1.0, 0.0]] * 3
    assert memory.running_length.tolist() == [1, 1, 1]


# -- RolloutMemory ---------------------------------------------------------------------


def make_rollout(num_agents=3, length=4):
    return RolloutMemory(num_agents, length,
                         step_fields={"x": ((), torch.float32), "a": ((2,), torch.int64)},
                         end_fields={"after": ((), torch.float32)})


def append_step(memory, agents, value):
    agents = torch.as_tensor(agents)
    memory.append(agents, x=torch.full((len(agents),), float(value)),
                  a=torch.stack([agents, agents + value], 1))


def test_rollout_memory_segments_ends_and_cut():
    memory = make_rollout()
    agents = torch.arange(3)
    for step in range(4):
        append_step(memory, agents, step)
        if step == 1:  # agent 1's episode ends after its second step
            memory.end_segments(torch.tensor([1]), after=torch.tensor([7.0]))
        if step == 2:  # agent 0's env is reset: its episode is cut without a next state
            memory.discard(torch.tensor([0]))
        assert memory.full == (step == 3)
    assert memory.stored == 12
    # The rollout is cut after the last step: every agent bootstraps there.
    memory.end_segments(agents, after=torch.tensor([1.0, 2.0, 3.0]))
    data = memory.data()
    assert data["x"].tolist() == [[0.0, 1.0, 2.0, 3.0]] * 3
    assert data["a"][2].tolist() == [[2, 2], [2, 3], [2, 4], [2, 5]]
    assert data["ends"].tolist() == [[False, False, True, True], [False, True, False, True],
                                     [False, False, False, True]]
    assert data["valid"].tolist() == [[False, False, False, True], [True] * 4, [True] * 4]
    # End fields: a row per segment end, in the order of ends' true entries (the discarded
    # segment's end has zeros).
    assert data["after"].tolist() == [0.0, 1.0, 7.0, 2.0, 3.0]
    # A discard right after an end, or of an agent with nothing stored, changes nothing.
    memory.discard(agents)
    assert memory.data()["valid"].sum() == 9
    memory.clear()
    assert not memory.full and memory.stored == 0
    assert not memory.data()["ends"].any() and not memory.data()["valid"].any()
    assert memory.data()["after"].numel() == 0
    # Episodes go on in the next rollout: nothing left over from the last one.
    memory.discard(torch.tensor([2]))
    append_step(memory, agents, 5)
    assert memory.data()["valid"][:, 0].all() and not memory.data()["ends"].any()


def test_rollout_memory_keeps_a_row_per_segment_end_and_grows_when_more_end():
    memory = make_rollout(length=4)
    agents = torch.arange(3)
    for step in range(4):  # agents 0 and 2 end an episode at every step, in reverse order
        append_step(memory, agents, step)
        memory.end_segments(torch.tensor([2, 0]), after=torch.tensor([20.0 + step, step]))
    memory.end_segments(agents, after=torch.tensor([-1.0, -2.0, -3.0]))
    data = memory.data()
    assert data["ends"].sum() == 9 and data["ends"][1].tolist() == [False] * 3 + [True]
    assert data["after"].tolist() == [0.0, 1.0, 2.0, 3.0, -2.0, 20.0, 21.0, 22.0, 23.0]
    # (a last end of agents 0 and 2 found nothing new to end)
    assert memory.state_dict()["end_values"]["after"].shape == (9,)
    memory.clear()
    append_step(memory, agents, 0)
    memory.end_segments(agents, after=torch.tensor([4.0, 5.0, 6.0]))
    assert memory.data()["after"].tolist() == [4.0, 5.0, 6.0]


def test_rollout_memory_loads_a_state_with_end_fields_at_every_step():
    memory = make_rollout()
    agents = torch.arange(3)
    append_step(memory, agents, 1)
    memory.end_segments(torch.tensor([2, 0]), after=torch.tensor([5.0, 4.0]))
    append_step(memory, agents, 2)
    state = memory.state_dict()
    dense = torch.zeros(3, 4)
    dense[0, 0], dense[2, 0] = 4.0, 5.0
    old = {"buffers": {**state["buffers"], "after": dense}, "steps": state["steps"],
           "segment_start": state["segment_start"]}
    other = make_rollout()
    other.load_state_dict(old)
    for name, value in memory.data().items():
        assert torch.equal(other.data()[name], value), name


def test_rollout_memory_errors():
    memory = make_rollout(length=2)
    agents = torch.arange(3)
    with pytest.raises(KeyError, match="step fields"):
        memory.append(agents, x=torch.ones(3))
    with pytest.raises(ValueError, match=r"'a' must have shape \(3, 2\), got \(2,\)"):
        memory.append(agents, x=torch.ones(3), a=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(KeyError, match="not an end field"):
        memory.end_segments(agents, nope=torch.ones(3))
    append_step(memory, [0], 0)
    append_step(memory, [0], 1)  # agent 0 is full, the others are not
    append_step(memory, [1, 2], 0)
    with pytest.raises(RuntimeError, match="length=2"):
        append_step(memory, [0, 1], 2)
    append_step(memory, [1, 2], 1)
    assert memory.full
    memory.end_segments(torch.tensor([1, 1]))  # (one end step, two end rows)
    with pytest.raises(RuntimeError, match="an agent twice in one call"):
        memory.data()
    with pytest.raises(ValueError, match="length >= 1"):
        make_rollout(length=0)


def test_rollout_memory_state_dict_round_trip():
    memory = make_rollout()
    agents = torch.arange(3)
    append_step(memory, agents, 1)
    memory.end_segments(torch.tensor([2]), after=torch.tensor([5.0]))
    append_step(memory, agents, 2)
    other = make_rollout()
    other.load_state_dict(memory.state_dict())
    assert other.stored == 6 and other.steps.tolist() == [2, 2, 2]
    assert other.segment_start.tolist() == [0, 0, 1]
    for name, buffer in memory.data().items():
        assert torch.equal(other.data()[name], buffer)
    append_step(other, agents, 3)
    append_step(other, agents, 4)
    assert other.full


def test_statistics_add_and_subtract_are_those_of_the_union_and_the_rest():
    rng = np.random.default_rng(8)
    first, second = rng.normal(2.0, 3.0, size=(7, 3)), rng.normal(-1.0, 0.5, size=(12, 3))

    def stats(values):
        values = torch.from_numpy(values)
        return Statistics(torch.tensor(float(len(values)), dtype=torch.float64),
                          values.mean(0), ((values - values.mean(0)) ** 2).sum(0))

    union, a, b = stats(np.concatenate([first, second])), stats(first), stats(second)
    for got, want in zip(a + b, union):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(union - a, b):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for got, want in zip(Statistics.from_flat(union.flat(), (3,)), union):
        assert torch.equal(got, want)


def test_normalizer_load_statistics_renews_what_transform_uses(host_path, defer):
    source = StreamingNormalizer((2,), defer=defer)
    source.update(torch.tensor([[0.0, 10.0], [2.0, 10.0], [4.0, 16.0]]))
    target = StreamingNormalizer((2,), defer=defer)
    target.update(torch.tensor([[100.0, -5.0], [300.0, 5.0]]))
    probe = torch.tensor([[3.0, 12.0], [1.0, -1.0]])
    target.transform(probe)  # derived statistics made before the load
    target.load_statistics(source.statistics())
    assert float(target.count) == 3
    assert torch.equal(target.transform(probe), source.transform(probe))


def test_normalizer_clip_alone_clips_a_float32_input(host_path, defer):
    normalizer = StreamingNormalizer((), center=False, scale=False, clip=2.0, defer=defer)
    normalizer.update(torch.tensor([1.0, 5.0]))
    values = torch.tensor([-7.0, 1.5, 9.0])
    assert normalizer.transform(values).tolist() == [-2.0, 1.5, 2.0]
    assert values.tolist() == [-7.0, 1.5, 9.0]  # the input is left as it was


def test_discounted_cumsum_of_float32_values_and_factors_is_computed_in_float64():
    rng = np.random.default_rng(9)
    values = torch.from_numpy(rng.normal(size=(5, 1000))).float()
    factors = torch.from_numpy(rng.uniform(0.9, 1.0, size=(5, 1000))).float()
    result = discounted_cumsum(values, factors)
    assert result.dtype == torch.float32
    assert torch.equal(result, discounted_cumsum(values.double(), factors.double()).float())


def test_gae_of_float32_inputs_is_float32_computed_in_float64():
    rng = np.random.default_rng(10)
    reward, value, next_value = (torch.from_numpy(rng.normal(size=(4, 300))).float()
                                 for _ in range(3))
    ends = torch.from_numpy(rng.uniform(size=(4, 300)) < 0.05)
    result = gae(reward, value, next_value, ends, 0.99, 0.95)
    assert result.dtype == torch.float32
    expected = gae(reward.double(), value.double(), next_value.double(), ends, 0.99, 0.95)
    assert torch.equal(result, expected.float())


# --- normaliser: eps, constant features, empty statistics, loading -----------------------

def test_normalizer_eps_is_added_to_the_standard_deviation(host_path, defer):
    """``eps`` is added to the std (not to the variance, not ignored, not fixed at 1e-8)."""
    normalizer = StreamingNormalizer((1,), eps=0.5, defer=defer)
    normalizer.update(torch.tensor([[0.0], [2.0]]))  # mean 1, std sqrt(2)
    result = normalizer.transform(torch.tensor([[3.0], [1.0]]))
    np.testing.assert_allclose(result.numpy(), [[2.0 / (np.sqrt(2.0) + 0.5)], [0.0]], rtol=1e-6)


def test_normalizer_constant_feature_is_finite_and_clipped(host_path, defer):
    """An observation dimension that never changes (std 0) normalises to finite values: 0 at
    its value, +-clip elsewhere, never NaN or inf."""
    normalizer = StreamingNormalizer((2,), clip=5.0, defer=defer)
    normalizer.update(torch.tensor([[1.0, 7.0], [3.0, 7.0], [2.0, 7.0]]))
    result = normalizer.transform(torch.tensor([[2.0, 7.0], [2.0, 8.0], [2.0, 6.0]]))
    assert torch.isfinite(result).all()
    assert result[:, 1].tolist() == [0.0, 5.0, -5.0]
    assert result[:, 0].tolist() == [0.0, 0.0, 0.0]


def test_statistics_with_nothing_added_change_nothing():
    """A learner that added nothing since the last merge sends ``current - synced`` with count
    0: it must be all zeros, and adding it (or adding two empty sets) must leave statistics
    exact and finite."""
    values = torch.tensor([[1.0, -2.0], [3.0, 5.0], [4.0, 0.5]], dtype=torch.float64)
    a = Statistics(torch.tensor(3.0, dtype=torch.float64), values.mean(0),
                   ((values - values.mean(0)) ** 2).sum(0))
    nothing = a - a
    assert float(nothing.count) == 0
    assert nothing.mean.tolist() == [0.0, 0.0] and nothing.sum_sq.tolist() == [0.0, 0.0]
    for got, want in zip(a + nothing, a):
        assert torch.equal(got, want)
    empty = Statistics(*(torch.zeros_like(value) for value in a))
    for got, want in zip(empty + empty, empty):
        assert torch.equal(got, want)
    for got, want in zip(empty + a, a):
        assert torch.equal(got, want)


def test_normalizer_load_state_dict_renews_what_transform_uses(host_path, defer):
    """A normaliser that already transformed (its float32 copies derived) and then loads a
    state dict transforms with the loaded statistics."""
    source = StreamingNormalizer((2,), defer=defer)
    source.update(torch.tensor([[0.0, 10.0], [2.0, 10.0], [4.0, 16.0]]))
    target = StreamingNormalizer((2,), defer=defer)
    target.update(torch.tensor([[100.0, -5.0], [300.0, 5.0]]))
    probe = torch.tensor([[3.0, 12.0], [1.0, -1.0]])
    target.transform(probe)
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.transform(probe), source.transform(probe))


# --- memories: dtypes, lengths, a loaded memory's bounds ----------------------------------

def pixel_memory(max_length=3):
    return EpisodeMemory(3, 2, max_length,
                         step_fields={"observ": ((4,), torch.uint8), "x": ((), torch.float32)},
                         episode_fields={"last": ((4,), torch.uint8)})


def test_memory_keeps_the_dtypes_of_its_fields(host_path):
    """uint8 pixels stay bytes in the running buffers, the update memory and data() (4x less
    memory than float32), every byte value exact."""
    memory = pixel_memory()
    agents = torch.arange(3)
    frames = torch.tensor([[0, 1, 128, 255], [7, 200, 254, 3], [9, 9, 9, 9]], dtype=torch.uint8)
    memory.append(agents, observ=frames, x=torch.ones(3))
    memory.set_episode(agents, last=frames.flip(0))
    assert memory.finish(torch.tensor([0, 1])) == 2
    for buffers in (memory.running, memory.stored):
        assert buffers["observ"].dtype == buffers["last"].dtype == torch.uint8
        assert buffers["x"].dtype == torch.float32
    data, _ = memory.data()
    assert data["observ"].dtype == data["last"].dtype == torch.uint8
    assert torch.equal(data["observ"][:, 0], frames[:2])
    assert torch.equal(data["last"], frames.flip(0)[:2])


def test_memory_data_is_cut_to_the_longest_stored_episode(host_path):
    """data()'s step fields are (count, T', ...) with T' the longest stored episode, not
    max_length; episode fields are (count, ...)."""
    memory = pixel_memory(max_length=5)
    for agents in (torch.arange(3), torch.tensor([0, 2])):
        memory.append(agents, observ=torch.zeros(len(agents), 4, dtype=torch.uint8),
                      x=torch.ones(len(agents)))
    memory.finish(torch.tensor([1, 0]))
    data, length = memory.data()
    assert length.tolist() == [1, 2]
    assert data["observ"].shape == (2, 2, 4) and data["x"].shape == (2, 2)
    assert data["last"].shape == (2, 4)


def test_a_loaded_memory_refuses_a_step_past_max_length(host_path):
    """After load_state_dict (a resume) a full running episode still refuses another step,
    instead of writing it into the next agent's first step."""
    memory = pixel_memory(max_length=2)
    agents = torch.arange(3)
    for step in (1, 2):
        memory.append(agents, observ=torch.full((3, 4), step, dtype=torch.uint8),
                      x=torch.full((3,), float(step)))
    loaded = pixel_memory(max_length=2)
    loaded.load_state_dict(memory.state_dict())
    with pytest.raises(RuntimeError, match="max_length=2"):
        loaded.append(torch.tensor([0]), observ=torch.full((1, 4), 9, dtype=torch.uint8),
                      x=torch.tensor([9.0]))
    assert loaded.running["x"][:, :2].tolist() == [[1.0, 2.0]] * 3


def test_a_loaded_rollout_refuses_a_step_past_its_length(host_path):
    """The same for RolloutMemory: a full rollout loaded from a checkpoint refuses another
    step (no write into the next agent's row)."""
    memory = RolloutMemory(3, 2, {"x": ((), torch.float32)})
    agents = torch.arange(3)
    for step in (1, 2):
        memory.append(agents, x=torch.full((3,), float(step)))
    loaded = RolloutMemory(3, 2, {"x": ((), torch.float32)})
    loaded.load_state_dict(memory.state_dict())
    assert loaded.full
    with pytest.raises(RuntimeError, match="length=2"):
        loaded.append(torch.tensor([0]), x=torch.tensor([9.0]))
    assert loaded.data()["x"].tolist() == [[1.0, 2.0]] * 3


@pytest.mark.parametrize("kind", ["episode", "rollout"])
def test_append_refuses_values_for_another_number_of_agents(host_path, kind):
    """A value with one row for three agents is an error, not broadcast to all three (numpy
    would)."""
    fields = {"x": ((2,), torch.float32)}
    memory = (EpisodeMemory(3, 1, 4, fields) if kind == "episode"
              else RolloutMemory(3, 4, fields))
    with pytest.raises(ValueError, match=r"'x' must have shape \(3, 2\), got \(1, 2\)"):
        memory.append(torch.arange(3), x=torch.ones(1, 2))


# --- normaliser: batches of any leading shape, moves that replace the buffers ----------------

def test_normalizer_update_takes_values_of_any_leading_shape(host_path, defer):
    """``update`` flattens the leading dimensions (an ``(E, T)`` grid of rewards, ``(T, N,
    *shape)`` observations) into one batch, as ``transform`` takes them: the statistics are
    those of every value, not an error or statistics per column."""
    rewards = StreamingNormalizer((), defer=defer)
    grid = torch.tensor([[1.0, 2.0, 3.0], [4.0, 6.0, 8.0]])
    rewards.update(grid)
    assert float(rewards.count) == 6
    np.testing.assert_allclose(float(rewards.mean), 4.0)
    np.testing.assert_allclose(float(rewards.variance), np.var(grid.numpy(), ddof=1))
    observ = StreamingNormalizer((2,), defer=defer)
    steps = torch.arange(12, dtype=torch.float32).reshape(3, 2, 2)  # (T, N, 2)
    observ.update(steps)
    assert float(observ.count) == 6
    assert observ.mean.tolist() == steps.reshape(6, 2).mean(0).tolist()


MOVES = ["cast", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.mark.parametrize("move", MOVES)
def test_normalizer_moved_after_use_updates_and_transforms_with_its_new_buffers(move, defer):
    """A move replaces the buffers (``.to("cuda")``; on the CPU, a cast replaces them too): a
    normaliser that already updated and transformed (its numpy views and float32 copies made)
    must derive them again from the new buffers, or its updates would go to the old ones and
    its transforms read stale (or CPU) statistics."""
    normalizer = StreamingNormalizer((2,), defer=defer)
    normalizer.update(torch.tensor([[0.0, 10.0], [2.0, 10.0], [4.0, 16.0]]))
    normalizer.transform(torch.zeros(1, 2))
    if move == "cast":
        normalizer.to(torch.float32)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
        normalizer.to(device)
    assert normalizer.mean.device.type == device.type
    normalizer.update(torch.tensor([[6.0, 4.0]], device=device))
    assert float(normalizer.count) == 4
    assert normalizer.mean.cpu().tolist() == [3.0, 10.0]
    # var (ddof=1) [20/3, 24]
    result = normalizer.transform(torch.tensor([[3.0, 10.0 + np.sqrt(24.0)]], device=device))
    assert result.device.type == device.type
    np.testing.assert_allclose(result.cpu().numpy(), [[0.0, 1.0]], rtol=1e-6, atol=1e-6)


# --- rollout memory: stored data, ends without values ---------------------------------------

def test_rollout_memory_stores_values_that_require_grad_as_data():
    """A step or end value that requires grad is stored as data: the buffers never join a
    graph (which would keep every step's graph alive until the update, and make the update's
    backward reach into them)."""
    memory = make_rollout(length=2)
    agents = torch.arange(3)
    weight = torch.ones(3, requires_grad=True)
    memory.append(agents, x=weight * 2.0, a=torch.zeros(3, 2, dtype=torch.int64))
    memory.end_segments(agents, after=weight * 3.0)
    data = memory.data()
    for name in ("x", "after"):
        assert not data[name].requires_grad and data[name].grad_fn is None, name
    assert data["x"][:, 0].tolist() == [2.0] * 3 and data["after"].tolist() == [3.0] * 3


def test_rollout_memory_an_end_without_values_has_zeros_in_a_row_used_before():
    """End fields not given (a discarded segment, a cut with nothing to bootstrap from) are
    zeros, also in the end rows a previous rollout filled: nothing of that rollout is left."""
    memory = make_rollout(length=2)
    agents = torch.arange(3)
    append_step(memory, agents, 0)
    memory.end_segments(agents, after=torch.tensor([5.0, 6.0, 7.0]))
    memory.clear()
    append_step(memory, agents, 1)
    memory.discard(torch.tensor([1]))
    memory.end_segments(torch.tensor([0, 2]))
    data = memory.data()
    assert data["ends"][:, 0].tolist() == [True] * 3
    assert data["after"].tolist() == [0.0, 0.0, 0.0]
