"""The package's import graph: no circles, no module imports another's private
names, and no module imports a layer above it (``LAYERS``). Imports inside
functions count too: a lazy import is still a dependency, and a circle through
one is still a circle."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import batchrl

ROOT = pathlib.Path(batchrl.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every ``import``/``from ... import`` of a
    batchrl module in ``path``; ``names`` is empty for ``import x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "batchrl":
                found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names
                      if alias.name.split(".")[0] == "batchrl"]
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, names in imports(path):
            # "from package import module" depends on the module itself.
            for imported in names:
                if f"{target}.{imported}" in modules:
                    edges[name].add(f"{target}.{imported}")
            if target in modules and not (names and all(f"{target}.{n}" in modules
                                                         for n in names)):
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_import_graph_has_no_circle():
    assert cycles(graph()) == []


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_private_names():
    offenders = [f"{module_name(path)} imports {name} from {target}"
                 for path in ROOT.rglob("*.py") for target, names in imports(path)
                 for name in names if name.startswith("_")]
    assert offenders == []


# The layers of the package and the layers each may import (besides its own). The env layer
# knows nothing of torch, algorithms or the loop; its core (BatchEnv, the Worker protocol, the
# env host) knows no concrete transport; the algorithms and their parts know no env; only the
# application layer (trainer, config, commands) assembles everything, through the env layer's
# front (factory, vector env, package), never a transport directly.
LAYERS = {
    "base": set(),
    "testing": {"base"},
    "env core": {"base"},
    "transports": {"base", "env core"},
    "env front": {"base", "env core", "transports"},
    "parts": {"base"},
    "algorithms": {"base", "parts"},
    "loop": {"base", "env core", "parts", "algorithms"},
    "collectors": {"base", "env core", "env front", "transports", "parts", "algorithms", "loop"},
    "learners": {"base", "env core", "env front", "transports", "parts", "algorithms", "loop"},
    "application": {"base", "env core", "env front", "parts", "algorithms", "loop", "collectors",
                    "learners"},
}


def layer(module: str) -> str:
    """The layer of a batchrl module (see ``LAYERS``)."""
    if module in ("batchrl.lazy", "batchrl.hardware", "batchrl.interrupt", "batchrl.errors",
                  "batchrl.pixels", "batchrl.nested"):
        return "base"
    if module.startswith(("batchrl.envs.process", "batchrl.envs.ray")):
        return "transports"
    if module in ("batchrl.envs", "batchrl.envs.factory", "batchrl.envs.vector"):
        return "env front"
    for prefix, name in (("batchrl.envs.", "env core"), ("batchrl.parts", "parts"),
                         ("batchrl.algos", "algorithms"), ("batchrl.testing", "testing")):
        if module.startswith(prefix):
            return name
    if module in ("batchrl.tensor_env", "batchrl.simulation"):
        return "loop"
    if module.startswith("batchrl.collectors"):
        return "collectors"
    if module == "batchrl.learners.ray":  # (placing learners; launching them is the application's)
        return "learners"
    return "application"


def test_no_module_imports_a_layer_above_it():
    offenders = [f"{module} ({layer(module)}) imports {target} ({layer(target)})"
                 for module, targets in sorted(graph().items()) for target in sorted(targets)
                 if layer(target) != layer(module)
                 and layer(target) not in LAYERS[layer(module)]]
    assert offenders == []


def test_the_layer_check_finds_an_upward_import():
    assert layer("batchrl.envs.batch") == "env core"
    assert layer("batchrl.envs.process.external") == "transports"
    assert "transports" not in LAYERS["env core"] and "env core" not in LAYERS["algorithms"]
    assert "transports" not in LAYERS["application"]


def test_main_names_import_from_the_top_level():
    from batchrl import (Algorithm, BatchEnv, BatchPPO, EnvWorker, ExternalProcess, Reinforce,
                         TensorBatchEnv, make_batch_env, simulate)
    from batchrl.simulation import simulate as the_function
    assert simulate is the_function and callable(simulate)
    assert issubclass(BatchPPO, Algorithm) and issubclass(Reinforce, Algorithm)
    assert all(callable(x) for x in (BatchEnv, EnvWorker, ExternalProcess, TensorBatchEnv,
                                     make_batch_env))
    assert set(batchrl.__all__) <= set(dir(batchrl))
    with pytest.raises(AttributeError, match="no attribute 'simulat'"):
        batchrl.simulat  # noqa: B018


def test_every_export_of_the_env_layer_is_listed_and_there():
    import batchrl.envs
    assert set(batchrl.envs.__all__) <= set(dir(batchrl.envs))
    assert all(hasattr(batchrl.envs, name) for name in batchrl.envs.__all__)


def test_importing_batchrl_or_its_env_layer_does_not_import_torch():
    # Env worker processes import the package: torch there would cost seconds.
    code = ("import sys, batchrl, batchrl.envs; "
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_algos_export_their_names_and_ppo_config_needs_no_torch():
    import batchrl.algos
    from batchrl.algos import networks, ppo_config
    assert all(hasattr(batchrl.algos, name) for name in batchrl.algos.__all__)
    assert set(batchrl.algos.__all__) <= set(dir(batchrl.algos))
    assert tuple(networks.ACTIVATIONS) == ppo_config.ACTIVATIONS
    code = ("import sys; from batchrl.algos import PPOConfig; import batchrl.config; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("args", [["--config", "cartpole", "--steps", "0"],
                                  ["--config", "cartpole", "--set", "env.id=NoSuch-v0"]])
def test_train_reports_a_bad_config_or_env_id_before_importing_torch(args, tmp_path):
    code = ("import sys; from batchrl.train import main; "
            f"code = main({args!r}); print(code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.split() == ["2", "False"], result
    assert result.stderr.startswith("error: ") and not list(tmp_path.iterdir())


BENCHMARKS = sorted((ROOT.parent / "benchmarks").glob("*.py"))


def _puts_its_checkout_first(node: ast.stmt) -> bool:
    """``sys.path.insert(0, str(Path(__file__).resolve().parents[1]))``."""
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "sys.path.insert"
            and "Path(__file__).resolve().parents[1]" in ast.unparse(node.value))


def _imports_batchrl(node: ast.AST) -> bool:
    return ((isinstance(node, ast.ImportFrom) and (node.module or "").startswith("batchrl"))
            or (isinstance(node, ast.Import)
                and any(alias.name.startswith("batchrl") for alias in node.names)))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda path: path.stem)
def test_every_benchmark_imports_the_batchrl_of_its_own_checkout(path):
    """(Run from a second clone, a benchmark would otherwise measure the batchrl installed
    from the first.)"""
    body = ast.parse(path.read_text()).body
    first = next((i for i, node in enumerate(body) if _puts_its_checkout_first(node)), None)
    uses = [i for i, node in enumerate(body) if _imports_batchrl(node)]
    assert any(_imports_batchrl(node) for node in ast.walk(ast.Module(body, [])))
    assert first is not None and all(first < i for i in uses), path.name


def test_a_benchmark_copied_into_another_checkout_imports_that_checkout(tmp_path):
    (tmp_path / "batchrl").mkdir()
    (tmp_path / "batchrl" / "__init__.py").write_text('raise SystemExit("the copy\'s batchrl")\n')
    (tmp_path / "benchmarks").mkdir()
    script = tmp_path / "benchmarks" / "memory.py"
    script.write_text((ROOT.parent / "benchmarks" / "memory.py").read_text())
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "the copy's batchrl" in result.stderr, result.stderr
