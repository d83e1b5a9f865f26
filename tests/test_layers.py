"""The package's import graph: layers import only downward, and no module cycles.

Read from the source with `ast` (imports inside functions count too: they are dependencies).
"""

import ast
import pathlib

import jrl

ROOT = pathlib.Path(jrl.__file__).resolve().parent

# Each subpackage may import only subpackages of a strictly lower layer.
LAYERS = {
    "kernels": 0, "metrics": 0, "data": 0,
    "losses": 1, "rewards": 1, "models": 1,
    "parallel": 2, "sampling": 2, "envs": 2,
    "train": 3,
    "pipeline": 4,
    "configs": 5,
    "cli": 6,
}


# jrl.pipeline's folders, the same way: a folder imports only folders of a strictly lower floor
# (the config reads itself into the parts' option types, so it stands above the rollout side;
# setup builds the parts from the config; the loop runs what setup built).
PIPELINE_FLOORS = {
    "rollout": 0,
    "training": 1, "config": 1,
    "setup": 2,
    "loop": 3,
}


def _module_name(path: pathlib.Path) -> str:
    parts = ("jrl",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the jrl modules it imports (a name imported from a package counts as the
    submodule when one of that name exists)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("jrl")}
            elif isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("jrl"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS)


def _is_root_helper(parts: list[str]) -> bool:
    """A module at the package root (jrl/checks.py, jrl/io_errors.py): a shared helper below
    every layer, so it may import nothing from jrl."""
    return len(parts) == 2 and not (ROOT / parts[1] / "__init__.py").exists()


def test_root_helpers_import_nothing_from_jrl():
    graph = _imports()
    helpers = [m for m in graph if _is_root_helper(m.split("."))]
    assert helpers, "expected shared helpers at the package root"
    assert {m: sorted(graph[m]) for m in helpers if graph[m]} == {}


def test_layers_import_only_downward():
    wrong = []
    for module, targets in _imports().items():
        parts = module.split(".")
        if len(parts) < 2 or _is_root_helper(parts):
            continue
        for target in targets:
            other = target.split(".")
            if len(other) < 2 or other[1] == parts[1] or _is_root_helper(other):
                continue
            if LAYERS[other[1]] >= LAYERS[parts[1]]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_import_cycles_between_modules():
    graph = _imports()
    # A package's __init__ re-exports its modules: edges into an __init__ from its own
    # submodules are the package importing itself, not a cycle of design.
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_pipeline_folders_import_only_downward():
    pipeline = ROOT / "pipeline"
    folders = {p.name for p in pipeline.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(PIPELINE_FLOORS)
    wrong = []
    for module, targets in _imports().items():
        parts = module.split(".")
        if parts[:2] != ["jrl", "pipeline"] or len(parts) < 4:
            continue
        for target in targets:
            other = target.split(".")
            if other[:2] != ["jrl", "pipeline"] or len(other) < 3 or other[2] == parts[2] \
                    or other[2] not in PIPELINE_FLOORS:
                continue
            if PIPELINE_FLOORS[other[2]] >= PIPELINE_FLOORS[parts[2]]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []
