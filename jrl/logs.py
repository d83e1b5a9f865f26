"""jrl's log lines, through Python's logging under the "jrl" logger.

The library's parts take a `log` callable for their progress lines (default `info`: a record at
INFO on the "jrl" logger), so a test or a caller can collect them instead. The library adds no
handler of its own (Python's convention): an application shows them with
`logging.basicConfig(level="INFO")` or `jrl.logs.configure()`, which is what `jrl train` does
with its `--verbosity`.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("jrl")
LOGGER.addHandler(logging.NullHandler())
VERBOSITY = ("debug", "info", "warning", "error")


def info(message: str) -> None:
    """One progress line at INFO."""
    LOGGER.info(message)


def warning(message: str) -> None:
    LOGGER.warning(message)


class _ByLevel(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        return message if record.levelno < logging.WARNING else \
            f"{record.levelname.lower()}: {message}"


class _CurrentStdout(logging.StreamHandler):
    """Writes to whatever sys.stdout is when a record comes (a test's capture or a notebook
    may have replaced it since the handler was made)."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


def configure(verbosity: str = "info", stream=None) -> None:
    """Shows the "jrl" logger's records at `verbosity` and above (one of VERBOSITY) on
    `stream` (default stdout), each as its message alone ("warning: ..." above INFO). Called
    again, it replaces the handler it installed before."""
    if verbosity not in VERBOSITY:
        raise ValueError(f"verbosity={verbosity!r}: allowed values are {list(VERBOSITY)}")
    for handler in [h for h in LOGGER.handlers if getattr(h, "_jrl_cli", False)]:
        LOGGER.removeHandler(handler)
    handler = logging.StreamHandler(stream) if stream is not None else _CurrentStdout()
    handler._jrl_cli = True
    handler.setFormatter(_ByLevel())
    LOGGER.addHandler(handler)
    LOGGER.setLevel(verbosity.upper())
    LOGGER.propagate = False
