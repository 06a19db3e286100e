"""The examples run and reach what their docstrings promise."""

from __future__ import annotations

import importlib.util

import pytest

from helpers import REPO


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cleanrl_style_ppo_trains_cartpole_to_500(capsys):
    example = load_example("cleanrl_style_ppo")
    assert example.main(["--total-steps", "100000"]) == 500.0
    output = capsys.readouterr().out
    assert "greedy episode returns: [500.0, 500.0" in output
