"""User code named in a config: "package.module:attribute" or "path/to/file.py:attribute".

The config keys that take one (algorithm.factory, env.name, rollout.reward_fn, data.record_adapter)
load it here, so a typo, a missing module or a file that fails to import is one ValueError
line naming the key, the value and what went wrong, at setup rather than mid-run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any


def is_plugin_spec(value: str) -> bool:
    """Whether `value` has the form "module:attribute" or "file.py:attribute"."""
    module, sep, attribute = value.rpartition(":")
    return bool(sep and module and attribute and attribute.isidentifier())


def check_plugin_spec(key: str, value: str) -> None:
    """ValueError naming `key` unless `value` is "package.module:attribute" or
    "path/to/file.py:attribute" (checked by form only; load_plugin imports it)."""
    if not is_plugin_spec(value):
        raise ValueError(f"{key}={value!r}: must be 'package.module:function' or "
                         "'path/to/file.py:function'")


def load_plugin(key: str, value: str) -> Any:
    """The attribute `value` names. A module path is imported with importlib (it must be on
    sys.path, e.g. installed or in the working directory); a path ending in .py is loaded as a
    module of its own (relative paths from the working directory). Raises ValueError naming
    `key` for a malformed value, a module or file that is missing or fails to import, or a
    missing attribute."""
    check_plugin_spec(key, value)
    location, _, attribute = value.rpartition(":")
    if location.endswith(".py"):
        module = _load_file(key, value, location)
    else:
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as error:
            if error.name and location.startswith(error.name):
                raise ValueError(f"{key}={value!r}: no module named {error.name!r} (install "
                                 "it, or run from the directory that holds it)") from None
            raise ValueError(f"{key}={value!r}: importing {location!r} failed: "
                             f"ModuleNotFoundError: {error}") from None
        except Exception as error:  # noqa: BLE001 - the user's module failed at import
            raise ValueError(f"{key}={value!r}: importing {location!r} failed: "
                             f"{type(error).__name__}: {error}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(f"{key}={value!r}: {location!r} has no attribute {attribute!r} "
                         f"(it has: {', '.join(public[:12]) or 'nothing public'})") from None


def _load_file(key: str, value: str, path: str):
    """A .py file as a module named after its absolute path (so two files of one name do not
    collide), registered in sys.modules so that pickling and dataclasses inside it work."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ValueError(f"{key}={value!r}: no file {path!r}")
    name = "jrl_plugin_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file failed at import
        del sys.modules[name]
        raise ValueError(f"{key}={value!r}: running {path!r} failed: "
                         f"{type(error).__name__}: {error}") from None
    return module
