"""The call protocol and return values of ``simulate()``, against a hand-written script."""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.wrappers import TimeLimit

from batchrl.algos import Algorithm, Summary
from batchrl.envs import BatchEnv
from batchrl.tensor_env import TensorBatchEnv
from batchrl.simulation import Simulation, evaluate_episodes, flush, simulate


class CountdownEnv(gym.Env):
    """Terminates after ``length`` steps; every step rewards ``reward``.

    The observation is ``[ident, t, last_action]`` with ``t`` the steps taken
    since the reset, so each transition can be checked exactly.
    """

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, ident: int, length: int, reward: float):
        self.ident, self.length, self.reward = ident, length, reward
        self.t = 0
        self.resets = 0

    def _observ(self, action: int) -> np.ndarray:
        return np.array([self.ident, self.t, action], np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        self.resets += 1
        return self._observ(-1), {}

    def step(self, action):
        assert self.t < self.length, "stepped after the episode terminated"
        self.t += 1
        return self._observ(int(action)), self.reward, self.t == self.length, False, {}


class Recorder(Algorithm):
    """Records every call with its arguments as Python lists; acts ``agent % 2``."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.calls: list[tuple[str, list[int]]] = []
        self.transitions: list[dict[str, list]] = []
        self.performed_observ: list[list[list[float]]] = []
        self.performed_training: list[bool] = []  # the mode of each perform()

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        assert agent_indices.dtype == torch.int64
        self.calls.append(("begin", agent_indices.tolist()))
        return {"begun": float(len(agent_indices))}

    def perform(self, agent_indices: torch.Tensor,
                observ: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        assert agent_indices.dtype == torch.int64 and observ.dtype == torch.float32
        self.calls.append(("perform", agent_indices.tolist()))
        self.performed_observ.append(observ.tolist())
        self.performed_training.append(self.training)
        return agent_indices % 2, {"performed": 1.0}

    def experience(self, agent_indices, observ, action, reward, done, next_observ,
                   terminated) -> Summary:
        self.calls.append(("experience", agent_indices.tolist()))
        self.transitions.append(dict(
            observ=observ.tolist(), action=action.tolist(), reward=reward.tolist(),
            done=done.tolist(), next_observ=next_observ.tolist(),
            terminated=terminated.tolist()))
        return {}

    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        self.calls.append(("end", agent_indices.tolist()))
        return {"ended": float(len(agent_indices))}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.fixture(autouse=True)
def _both_bookkeeping_paths(host_path):
    """Every test runs with simulate's numpy bookkeeping and with torch's."""


# Env i rewards i + 1 per step. Envs 0-2 terminate after 1, 2 and 3 steps;
# env 3 would run for 100 steps but a TimeLimit truncates it after 2.
LENGTHS = [1, 2, 3, 2]
REWARDS = [1.0, 2.0, 3.0, 4.0]


def make_env() -> TensorBatchEnv:
    envs: list[gym.Env] = [CountdownEnv(i, LENGTHS[i], REWARDS[i]) for i in range(3)]
    envs.append(TimeLimit(CountdownEnv(3, 100, REWARDS[3]), max_episode_steps=2))
    return TensorBatchEnv(BatchEnv(envs))


def test_call_script_scores_and_reset():
    env, algo = make_env(), Recorder()
    all_agents = [0, 1, 2, 3]
    # (reset, begun, ended, scores): the agents passed to begin_episodes and
    # end_episodes, and the returned running scores, step by step.
    script = [
        (False, all_agents, [0], [1, 2, 3, 4]),
        (False, [0], [0, 1, 3], [1, 4, 6, 8]),         # env 3 truncated
        (False, [0, 1, 3], [0, 2], [1, 2, 9, 4]),
        (False, [0, 2], [0, 1, 3], [1, 4, 3, 8]),
        # Reset discontinues env 2's episode after one step: every agent begins
        # anew and env 2's unfinished episode never ends.
        (True, all_agents, [0], [1, 2, 3, 4]),
        (False, [0], [0, 1, 3], [1, 4, 6, 8]),
        (False, [0, 1, 3], [0, 2], [1, 2, 9, 4]),
    ]
    for reset, begun, ended, scores in script:
        algo.calls.clear()
        done, score, summary = simulate(env, algo, reset=reset)
        assert algo.calls == [("begin", begun), ("perform", all_agents),
                              ("experience", all_agents), ("end", ended)]
        assert done.dtype == torch.bool and done.tolist() == [i in ended for i in all_agents]
        assert score.tolist() == scores
        # The summaries of all calls are merged.
        assert summary == {"begun": float(len(begun)), "performed": 1.0,
                           "ended": float(len(ended))}
    # Every env was reset exactly when its agent began an episode.
    begins = [sum(i in begun for _, begun, _, _ in script) for i in all_agents]
    assert [e.unwrapped.resets for e in env.batch_env.envs] == begins


def test_no_calls_for_empty_index_sets():
    # A single env that never ends within the test: no end_episodes at all,
    # and begin_episodes only on the first step.
    env = TensorBatchEnv(BatchEnv([CountdownEnv(0, 10, 1.0)]))
    algo = Recorder()
    for _ in range(3):
        simulate(env, algo)
    assert algo.calls == [("begin", [0]), ("perform", [0]), ("experience", [0]),
                          ("perform", [0]), ("experience", [0]),
                          ("perform", [0]), ("experience", [0])]


def test_transitions_seen_by_perform_and_experience():
    env, algo = make_env(), Recorder()
    for _ in range(3):
        simulate(env, algo)
    actions = [0, 1, 0, 1]  # Recorder acts agent % 2
    # Step 1: every env fresh from its reset (t = 0, last action -1).
    first, second, third = algo.transitions
    assert algo.performed_observ[0] == [[i, 0, -1] for i in range(4)]
    assert first["observ"] == algo.performed_observ[0]
    assert first["action"] == actions
    assert first["reward"] == REWARDS
    assert first["next_observ"] == [[i, 1, actions[i]] for i in range(4)]
    assert first["done"] == [1, 0, 0, 0]
    assert first["terminated"] == [1, 0, 0, 0]
    # Step 2: env 0 was reset; env 1 terminates, env 3 is truncated by its
    # TimeLimit: done but not terminated, with its real next observation.
    assert second["observ"] == [[0, 0, -1], [1, 1, 1], [2, 1, 0], [3, 1, 1]]
    assert second["next_observ"] == [[0, 1, 0], [1, 2, 1], [2, 2, 0], [3, 2, 1]]
    assert second["done"] == [1, 1, 0, 1]
    assert second["terminated"] == [1, 1, 0, 0]
    # Step 3: envs 0, 1 and 3 were reset; env 2 terminates after its 3 steps.
    assert third["observ"] == [[0, 0, -1], [1, 0, -1], [2, 2, 0], [3, 0, -1]]
    assert third["observ"] == algo.performed_observ[2]
    assert third["next_observ"] == [[0, 1, 0], [1, 1, 1], [2, 3, 0], [3, 1, 1]]
    assert third["done"] == [1, 0, 1, 0]
    assert third["terminated"] == [1, 0, 1, 0]


def test_log_means_over_episodes_finished_since_last_log():
    env, algo = make_env(), Recorder()
    # Steps 1-3 finish (score, length): env 0 three times (1, 1), env 1
    # (4, 2), env 3 (8, 2) and env 2 (9, 3).
    simulate(env, algo)
    simulate(env, algo)
    _, _, summary = simulate(env, algo, log=True)
    assert summary["episodes"] == 6
    assert summary["score"] == pytest.approx((3 * 1 + 4 + 8 + 9) / 6)
    assert summary["length"] == pytest.approx((3 * 1 + 2 + 2 + 3) / 6)
    # The totals restart after a log: step 4 finishes env 0 (1, 1), env 1
    # (4, 2) and env 3 (8, 2); the reset at step 5 discontinues env 2's
    # episode, which is not counted, and step 5 finishes env 0 (1, 1).
    simulate(env, algo)
    _, _, summary = simulate(env, algo, log=True, reset=True)
    assert summary["episodes"] == 4
    assert summary["score"] == pytest.approx((1 + 4 + 8 + 1) / 4)
    assert summary["length"] == pytest.approx((1 + 2 + 2 + 1) / 4)


def test_log_without_finished_episodes_reports_no_means():
    env, algo = TensorBatchEnv(BatchEnv([CountdownEnv(0, 2, 5.0)])), Recorder()
    _, _, summary = simulate(env, algo, log=True)
    assert "score" not in summary and "length" not in summary and "episodes" not in summary
    done, score, summary = simulate(env, algo, log=True)
    assert done.tolist() == [True] and score.tolist() == [10.0]
    assert (summary["score"], summary["length"], summary["episodes"]) == (10.0, 2.0, 1.0)
    # Logged episodes are not reported twice.
    _, _, summary = simulate(env, algo, log=True)
    assert "score" not in summary


def test_envs_keep_separate_state():
    # Two batch envs driven alternately: each has its own running episodes.
    first, second = make_env(), make_env()
    algo = Recorder()
    simulate(first, algo)
    algo.calls.clear()
    _, score, _ = simulate(second, algo)
    assert algo.calls[0] == ("begin", [0, 1, 2, 3])
    assert score.tolist() == [1, 2, 3, 4]
    algo.calls.clear()
    _, score, _ = simulate(first, algo)
    assert algo.calls[0] == ("begin", [0])
    assert score.tolist() == [1, 4, 6, 8]


def test_two_simulations_in_one_process_keep_their_own_episodes():
    # Each Simulation owns its loop state: interleaving two leaves each one's episodes as if
    # it ran alone, and the env object carries none of it.
    def alone(steps: int) -> list:
        simulation = Simulation(make_env())
        return [simulation.step(Recorder())[1].tolist() for _ in range(steps)]

    first, second = Simulation(make_env()), Simulation(make_env())
    algo = Recorder()
    scores = {id(first): [], id(second): []}
    for simulation in (first, first, second, first, second, second, first):
        scores[id(simulation)].append(simulation.step(algo)[1].tolist())
    assert scores[id(first)] == alone(4) and scores[id(second)] == alone(3)
    assert not hasattr(first.env, "episodes")


def _child_loop(queue) -> None:
    """A simulation loop in a child process: CartPole with a fixed policy."""
    env = TensorBatchEnv(BatchEnv([gym.make("CartPole-v1") for _ in range(2)]))
    simulation = Simulation(env)
    algo = Recorder()
    scores = [simulation.step(algo, reset=step == 0, seed=7 if step == 0 else None)[1].tolist()
              for step in range(30)]
    queue.put(scores)


def test_a_loop_in_a_child_process_runs_beside_one_here():
    import multiprocessing
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    child = context.Process(target=_child_loop, args=(queue,))
    child.start()
    try:
        here = Simulation(make_env())
        algo = Recorder()
        for _ in range(5):
            here.step(algo)
        scores = queue.get(timeout=60)
    finally:
        child.join(30)
    assert child.exitcode == 0
    # The child's loop counted its own episodes: the same as the same loop run here.
    env = TensorBatchEnv(BatchEnv([gym.make("CartPole-v1") for _ in range(2)]))
    simulation = Simulation(env)
    expected = [simulation.step(Recorder(), reset=step == 0,
                                seed=7 if step == 0 else None)[1].tolist() for step in range(30)]
    assert scores == expected
    assert here.episode_length.tolist() == [1, 1, 2, 1]


def test_a_new_simulation_starts_new_episodes_on_an_env_stepped_before():
    env, algo = make_env(), Recorder()
    simulate(env, algo)
    simulate(env, algo)
    algo.calls.clear()
    _, score, _ = Simulation(env).step(algo)
    assert algo.calls[0] == ("begin", [0, 1, 2, 3]) and score.tolist() == [1, 2, 3, 4]


def test_seeded_reset_resets_every_env_once_with_its_seed():
    class SeedRecorder(CountdownEnv):
        def reset(self, *, seed=None, options=None):
            self.seeds = getattr(self, "seeds", []) + [seed]
            return super().reset(seed=seed, options=options)

    env = TensorBatchEnv(BatchEnv([SeedRecorder(i, 5, 1.0) for i in range(3)]))
    algo = Recorder()
    simulation = Simulation(env)
    simulation.step(algo)
    simulation.step(algo)
    simulation.step(algo, reset=True, seed=100)
    # One reset per env at the start, then one seeded reset each: seed + index.
    assert [e.seeds for e in env.batch_env.envs] == [[None, 100], [None, 101], [None, 102]]
    # Episodes begin afresh: the loop's episode state is that of a new episode.
    assert simulation.episode_length.tolist() == [1, 1, 1]


def test_seeded_phases_repeat_their_episodes():
    def first_observations(steps_before: int) -> list:
        env = TensorBatchEnv(BatchEnv([gym.make("CartPole-v1") for _ in range(2)]))
        algo = Recorder()
        for _ in range(steps_before):
            simulate(env, algo)
        algo.performed_observ.clear()
        simulate(env, algo, reset=True, seed=7)
        return algo.performed_observ[0]

    assert first_observations(0) == first_observations(5)


def test_seed_without_reset_is_an_error():
    env, algo = make_env(), Recorder()
    with pytest.raises(ValueError, match="reset=True"):
        simulate(env, algo, seed=3)


def test_a_batch_env_instead_of_a_tensor_batch_env_is_named():
    env = make_env()
    with pytest.raises(TypeError, match=r"simulate\(\) needs a TensorBatchEnv .*got a "
                                        r"BatchEnv: wrap it as TensorBatchEnv\(batch_env, device\)"):
        simulate(env.batch_env, Recorder())
    with pytest.raises(TypeError, match=r"a simulation needs a TensorBatchEnv .*got a BatchEnv"):
        Simulation(env.batch_env)


class Broken(Recorder):
    """A Recorder with one method's return value replaced."""

    def __init__(self, method: str, value: Any):
        super().__init__()
        self.method, self.value = method, value

    def begin_episodes(self, agent_indices):
        result = super().begin_episodes(agent_indices)
        return self.value if self.method == "begin_episodes" else result

    def perform(self, agent_indices, observ):
        result = super().perform(agent_indices, observ)
        if self.method == "perform-action-only":
            return result[0]
        if self.method == "perform-numpy":
            return result[0].numpy(), {}
        if self.method == "perform-shape":
            return result[0][:, None], {}
        return (result[0], self.value) if self.method == "perform" else result

    def experience(self, *args):
        result = super().experience(*args)
        return self.value if self.method == "experience" else result

    def end_episodes(self, agent_indices):
        result = super().end_episodes(agent_indices)
        return self.value if self.method == "end_episodes" else result


@pytest.mark.parametrize("method, message", [
    ("begin_episodes", r"Broken.begin_episodes\(\) returned None; it must return a dict"),
    ("perform", r"Broken.perform\(\) returned None; it must return a dict"),
    ("experience", r"Broken.experience\(\) returned None; it must return a dict"),
    ("end_episodes", r"Broken.end_episodes\(\) returned None; it must return a dict"),
    ("perform-action-only", r"Broken.perform\(\) returned tensor\(.*\); it must return "
                            r"\(action, summary\)"),
    ("perform-numpy", r"Broken.perform\(\) returned an action of type ndarray; it must be a "
                      r"torch.Tensor"),
])
def test_what_an_algorithm_returns_is_checked_and_named(method, message):
    env, algo = make_env(), Broken(method, None)
    with pytest.raises(TypeError, match=message):
        simulate(env, algo)  # env 0 ends its episode at the first step


def test_actions_of_the_wrong_shape_name_perform():
    env, algo = make_env(), Broken("perform-shape", None)
    shape = tuple(env.action.shape)
    with pytest.raises(ValueError, match=re.escape(
            f"Broken.perform() returned actions of shape {(*shape, 1)}; the env takes "
            f"{shape} (num_agents, *action_space.shape)")):
        simulate(env, algo)


def test_evaluate_episodes_counts_equal_shares_in_episode_order():
    env, algo = make_env(), Recorder()
    scores, lengths = evaluate_episodes(env, algo, 6, seed=3)
    # Quotas 2, 2, 1, 1: every agent's first episode, then agents 0 and 1's second.
    assert scores == [1.0, 4.0, 9.0, 8.0, 1.0, 4.0]
    assert lengths == [1, 2, 3, 2, 1, 2]
    assert algo.performed_training and not any(algo.performed_training)  # it acted in eval
    assert algo.training  # its mode is restored
    with pytest.raises(ValueError, match="episodes must be >= 1"):
        evaluate_episodes(env, algo, 0)


def test_an_evaluation_leaves_a_loop_shared_with_training_as_training_had_it():
    """Training's log counts its own episodes, not the evaluation's, and the step after the
    evaluation starts new episodes for every agent (the evaluation reset the envs)."""
    env, algo = make_env(), Recorder()
    simulation = Simulation(env)
    simulation.step(algo, log=True)  # env 0 ends its 1-step episode
    simulation.step(algo)  # envs 0 (again), 1 and 3 end theirs
    simulation.evaluate(algo, 6)
    algo.calls.clear()
    _, score, summary = simulation.step(algo, log=True)
    assert algo.calls[0] == ("begin", [0, 1, 2, 3])
    # The second step's three episodes and this step's of env 0.
    assert summary["episodes"] == 4.0 and summary["score"] == (1.0 + 4.0 + 8.0 + 1.0) / 4


def test_evaluate_calls_after_step_every_step_and_stops_at_what_it_raises():
    steps: list[int] = []
    Simulation(make_env()).evaluate(Recorder(), 6, after_step=lambda: steps.append(1))
    assert len(steps) == 4  # agent 1's two episodes of 2 steps end last

    class Stop(Exception):
        pass

    def stop_at_the_second_step() -> None:
        steps.append(2)
        if steps.count(2) == 2:
            raise Stop

    algo = Recorder()
    before = torch.random.get_rng_state()
    with pytest.raises(Stop):
        Simulation(make_env()).evaluate(algo, 6, seed=3, after_step=stop_at_the_second_step)
    assert steps.count(2) == 2
    assert algo.training and torch.equal(torch.random.get_rng_state(), before)


class LaggingRecorder(Recorder):
    experience_may_lag = True


def test_overlap_delivers_experience_one_call_late_in_order():
    transitions = {}
    for overlap in (False, True):
        env, algo = TensorBatchEnv(BatchEnv([CountdownEnv(0, 4, 1.0)])), LaggingRecorder()
        for _ in range(5):
            simulate(env, algo, overlap=overlap)
        transitions[overlap] = algo.transitions
        if overlap:
            # experience() of a step without an episode end comes after the
            # next perform(); the step that ends the episode is delivered at
            # once, before end_episodes() and the next begin_episodes().
            assert algo.calls == [
                ("begin", [0]), ("perform", [0]),
                ("perform", [0]), ("experience", [0]),
                ("perform", [0]), ("experience", [0]),
                ("perform", [0]), ("experience", [0]), ("experience", [0]), ("end", [0]),
                ("begin", [0]), ("perform", [0])]
    # The same transitions (the fifth step's is still due), in the same order.
    assert transitions[True] == transitions[False][:4]


def test_flush_delivers_the_late_experience_once():
    env, algo = TensorBatchEnv(BatchEnv([CountdownEnv(0, 10, 2.0)])), LaggingRecorder()
    simulate(env, algo, overlap=True)
    assert [name for name, _ in algo.calls] == ["begin", "perform"]
    flush(env)
    flush(env)
    assert [name for name, _ in algo.calls] == ["begin", "perform", "experience"]
    assert algo.transitions == [dict(observ=[[0, 0, -1]], action=[0], reward=[2.0], done=[0.0],
                                     next_observ=[[0, 1, 0]], terminated=[0.0])]
    # A call without overlap (or with reset) delivers it first, too.
    simulate(env, algo, overlap=True)
    simulate(env, algo)
    assert [name for name, _ in algo.calls][3:] == ["perform", "experience", "perform",
                                                    "experience"]
    assert [t["observ"] for t in algo.transitions] == [[[0, 0, -1]], [[0, 1, 0]], [[0, 2, 0]]]


def test_algorithms_that_do_not_allow_a_lag_get_no_overlap():
    # Steps that end no episode (which an algorithm that allows a lag gets one call late).
    env, algo = TensorBatchEnv(BatchEnv([CountdownEnv(0, 4, 1.0)])), Recorder()
    for _ in range(2):
        simulate(env, algo, overlap=True)
    assert [name for name, _ in algo.calls] == [
        "begin", "perform", "experience", "perform", "experience"]


def test_overlap_trains_batchppo_exactly_as_without_it():
    """Real worker processes and HalfCheetah: with overlap the algorithm's
    whole state after two updates is bitwise the same."""
    from batchrl.algos import BatchPPO, PPOConfig
    from batchrl.envs.factory import make_batch_env

    results = {}
    for overlap in (False, True):
        batch_env = make_batch_env("HalfCheetah-v5", 4, max_length=20, backend="workers",
                                   workers=1)
        try:
            assert batch_env.workers, "the test needs envs in a worker process"
            env = TensorBatchEnv(batch_env)
            torch.manual_seed(3)
            algo = BatchPPO(env.observation_space, env.action_space, 4, PPOConfig(
                policy_layers=(16,), value_layers=(16,), update_every=4, update_epochs=2,
                inference="script"), max_length=20)
            batch_env.reset(seed=5)
            steps = []
            for step in range(50):
                done, score, _ = simulate(env, algo, reset=step == 0, overlap=overlap)
                steps.append((done.tolist(), score.tolist(), env.action.tolist()))
            flush(env)
            results[overlap] = steps, algo.state_dict(), algo.updates
        finally:
            batch_env.close()
    (steps, state, updates), (lag_steps, lag_state, lag_updates) = results[False], results[True]
    assert updates == lag_updates == 2
    assert steps == lag_steps

    def same(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        return a == b

    assert same(state, lag_state)


def test_the_returned_scores_are_a_copy_the_next_step_leaves_alone():
    env, algo = make_env(), Recorder()
    _, first, _ = simulate(env, algo)
    _, second, _ = simulate(env, algo)
    assert first.tolist() == [1, 2, 3, 4] and second.tolist() == [1, 4, 6, 8]


def test_reset_with_overlap_delivers_the_late_experience_before_begin_episodes():
    env, algo = TensorBatchEnv(BatchEnv([CountdownEnv(0, 10, 1.0)])), LaggingRecorder()
    simulate(env, algo, overlap=True)  # its experience is held back
    algo.calls.clear()
    simulate(env, algo, overlap=True, reset=True)
    assert [name for name, _ in algo.calls][:3] == ["experience", "begin", "perform"]
    assert algo.transitions[0]["observ"] == [[0, 0, -1]]


# --- overlap's late experience, evaluation modes and seeds -------------------------------

class SummarisingLaggingRecorder(LaggingRecorder):
    """Logs a scalar from every experience(), and the mode it was called in."""

    def __init__(self) -> None:
        super().__init__()
        self.experience_training: list[bool] = []

    def experience(self, *args):
        super().experience(*args)
        self.experience_training.append(self.training)
        return {"learned": float(len(self.experience_training))}


def test_a_late_experience_logs_its_summary_in_the_call_that_delivers_it():
    """With overlap, experience()'s summary is in the summary of the step (or flush) that
    delivers it, not lost."""
    env, algo = TensorBatchEnv(BatchEnv([CountdownEnv(0, 10, 1.0)])), SummarisingLaggingRecorder()
    _, _, summary = simulate(env, algo, overlap=True)
    assert "learned" not in summary  # held back
    _, _, summary = simulate(env, algo, overlap=True)
    assert summary["learned"] == 1.0  # the first step's, delivered while the env stepped
    assert flush(env) == {"learned": 2.0}
    assert flush(env) == {}


def test_an_evaluation_delivers_the_held_back_experience_while_still_training():
    """evaluate() first delivers the experience that overlap held back, in training mode:
    training learns from every step it took."""
    env, algo = TensorBatchEnv(BatchEnv([CountdownEnv(0, 10, 1.0)])), SummarisingLaggingRecorder()
    simulation = Simulation(env)
    simulation.step(algo, overlap=True)
    assert algo.experience_training == []  # held back
    simulation.evaluate(algo, 1)
    assert algo.experience_training[0] is True
    assert algo.transitions[0]["observ"] == [[0, 0, -1]]
    assert not any(algo.experience_training[1:])  # the evaluation's own steps


def test_an_evaluation_leaves_an_algorithm_in_evaluation_mode_in_it():
    """evaluate() restores the mode the algorithm had, evaluation included."""
    simulation, algo = Simulation(make_env()), Recorder()
    algo.eval()
    simulation.evaluate(algo, 4)
    assert not algo.training
    algo.train()
    simulation.evaluate(algo, 4)
    assert algo.training


class Sampler(Recorder):
    """Samples its actions from torch's global generator unless acting deterministically."""

    def __init__(self) -> None:
        Algorithm.__init__(self, "cpu", eval_actions="sample")
        self.calls, self.transitions, self.performed_observ = [], [], []
        self.performed_training, self.actions = [], []

    def perform(self, agent_indices, observ):
        action = (agent_indices % 2 if self.acting_deterministically
                  else torch.randint(0, 2, (len(agent_indices),)))
        self.actions.append(action.tolist())
        return action, {}


def test_a_sampled_evaluation_repeats_with_its_seed_whatever_the_global_generator_state():
    """The same evaluation seed draws the same actions, whatever draws came before."""
    def actions(global_seed: int, seed: int) -> list:
        algo = Sampler()
        torch.manual_seed(global_seed)
        Simulation(make_env()).evaluate(algo, 8, seed=seed)
        return algo.actions

    first = actions(global_seed=1, seed=5)
    assert len(first) >= 4 and actions(global_seed=2, seed=5) == first
    assert actions(global_seed=1, seed=6) != first
