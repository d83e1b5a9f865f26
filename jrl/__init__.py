"""jrl: a JAX functional RL trainer for language models."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("jrl")
except _metadata.PackageNotFoundError:     # a source tree that was never installed
    __version__ = "0+unknown"
