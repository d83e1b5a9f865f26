"""Run configs shipped with jrl: one Python file per run setup, each defining
get_config() -> a jrl.pipeline.RunConfig. `jrl train --config NAME` runs one by name."""

from __future__ import annotations

import pathlib

_HERE = pathlib.Path(__file__).parent


def names() -> list[str]:
    """The shipped configs' names (their module names)."""
    return sorted(p.stem for p in _HERE.glob("*.py") if not p.stem.startswith("_"))


def path(name: str) -> str | None:
    """The file of the shipped config `name` (with or without ".py"), else None."""
    stem = name[:-3] if name.endswith(".py") else name
    if stem not in names():
        return None
    return str(_HERE / f"{stem}.py")
