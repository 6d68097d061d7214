"""The package's shape: no import cycle, no upward import, no module over about 500 lines, a pure loss.

Imports are read from the source with `ast`, at any depth (an import inside a function is still a dependency: the
`analysis` <-> `evaluation` cycle this test was written against hid in one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "hf_rockopd"
MAX_LINES = 550  # "about 500": a module past this is doing more than one job


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports (a `from pkg import sub` counts as importing `pkg.sub`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            # `import hf_rockopd.losses.fused` names the deepest module the package has.
            while target and target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_graph_sees_relative_and_lazy_imports():
    graph = _graph()
    # __init__ re-exports the trainer, and the trainer uses the loss: both edges must be visible to the walk.
    assert any(target.startswith("hf_rockopd.losses") for deps in graph.values() for target in deps)
    assert graph["hf_rockopd"], "the package root imports nothing of ours?"


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (each list imports itself through the others):\n" + "\n".join(map(str, cycles))


def test_no_upward_import():
    """A module never imports a package that contains it: the root or its own package's `__init__`."""
    upward = [
        f"{name} imports {target}"
        for name, deps in _graph().items()
        for target in deps
        if name.startswith(target + ".")
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_size(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (limit {MAX_LINES}): split it by job"


def test_loss_is_pure():
    """The loss imports nothing of ours except itself, so any trainer base can use it."""
    graph = _graph()
    for name, deps in graph.items():
        if name == "hf_rockopd.losses" or name.startswith("hf_rockopd.losses."):
            outside = [d for d in deps if not (d == "hf_rockopd.losses" or d.startswith("hf_rockopd.losses."))]
            assert not outside, f"{name} imports {outside}"


def test_policies_never_import_a_trainer():
    graph = _graph()
    for name, deps in graph.items():
        if name.split(".")[1:2] == ["policies"]:
            trainers = [d for d in deps if "trainer" in d or d.endswith(".engine")]
            assert not trainers, f"{name} imports {trainers}"


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_only_the_command_line_imports_commands():
    """The library (every package, `distill`, the evaluation) never imports `commands/`: what a job and its command line
    both need (option checks, default training settings) lives below both, so the ablation or the evaluation can be
    used without the command line's parser."""
    graph = _graph()
    allowed = {"hf_rockopd.cli"}
    offenders = [
        f"{name} imports {target}"
        for name, deps in graph.items()
        if name not in allowed and not name.startswith("hf_rockopd.commands")
        for target in deps
        if target == "hf_rockopd.commands" or target.startswith("hf_rockopd.commands.")
    ]
    assert not offenders, "\n".join(offenders)


def test_evaluation_is_one_package():
    """Rollout, answers, quality, loops, the teacher reference, the evaluation and its table live in
    `hf_rockopd.evaluation`."""
    modules = _modules()
    for name in ("rollout", "answers", "quality", "loops", "teacher_reference", "evaluate", "table"):
        assert f"hf_rockopd.evaluation.{name}" in modules
        assert f"hf_rockopd.{name}" not in modules or name == "evaluate"
    assert "hf_rockopd.results_table" not in modules


ROOT_MODULES = {"__init__.py", "cli.py", "console.py", "_version.py"}


def test_package_root_holds_only_the_public_api():
    """The root holds the public API (`__init__`), the command line, the console and the version; every other module
    lives in the package for its job (`distill/`, `models/`, `data/`, `policies/`, `utils/`, ...)."""
    loose = sorted(p.name for p in PACKAGE_DIR.glob("*.py") if p.name not in ROOT_MODULES)
    assert not loose, (
        f"loose module(s) at the package root: {', '.join(loose)}; the root holds only {sorted(ROOT_MODULES)}. "
        "Put each in the package for its job (e.g. hf_rockopd/distill/, models/, data/, policies/, utils/)."
    )
