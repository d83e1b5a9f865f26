"""pyproject.toml declares what the library imports: every third-party module under jrl/ comes
from a declared dependency (required or an optional extra), and every required dependency is
imported, so that a dependency arriving only through another package's is caught."""

import ast
import functools
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])


def _imported_modules() -> set[str]:
    modules = set()
    for path in (ROOT / "jrl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return {m for m in modules if m != "jrl" and m not in sys.stdlib_module_names}


@functools.lru_cache(maxsize=None)
def _providers() -> dict:
    return importlib.metadata.packages_distributions()


def _distribution(module: str) -> str:
    """The distribution that provides `module` here, or the module's own name when it is not
    installed (an optional extra)."""
    names = _providers().get(module)
    return _normalize(names[0]) if names else _normalize(module)


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_requirement_name(r) for r in project["dependencies"]}
    optional = {_requirement_name(r) for extra in project["optional-dependencies"].values()
                for r in extra}
    return required, optional


def test_every_imported_module_is_declared():
    required, optional = _declared()
    undeclared = {m: _distribution(m) for m in _imported_modules()
                  if _distribution(m) not in required | optional}
    assert not undeclared, f"imported by jrl but not in pyproject.toml: {undeclared}"


def test_every_required_dependency_is_imported():
    required, _ = _declared()
    imported = {_distribution(m) for m in _imported_modules()}
    assert required <= imported, f"declared but never imported: {required - imported}"


def test_the_checks_are_not_vacuous():
    # jax, numpy, tqdm and jinja2 are imported by the library (tqdm by the progress bar,
    # jinja2 by the chat templates): the two that were once undeclared are seen.
    imported = {_distribution(m) for m in _imported_modules()}
    assert {"jax", "numpy", "tqdm", "jinja2", "orbax-checkpoint"} <= imported
