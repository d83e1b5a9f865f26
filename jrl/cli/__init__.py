"""The `jrl` command: one entry point with a subcommand per job.

    jrl train --config NAME [--set key=value ...]   train (jrl.cli.train; `jrl train --help`)
    jrl plot RUN_DIR [RUN_DIR ...]                   charts of runs' metrics (jrl.cli.plot)
    jrl convert --gguf FILE --out DIR                a GGUF file as a Hugging Face directory
    jrl local-cluster --processes N -- COMMAND       N CPU processes joined like cluster hosts
    jrl configs                                      the configs shipped with jrl
    jrl calibrate-tiles --config NAME --out FILE     measure this CPU's matmul row tiles
    jrl device-check                                 the GPU checks, from a repository checkout

Each subcommand's module also runs as `python -m jrl.cli.NAME`.
"""

from __future__ import annotations

import importlib
import os
import sys

USAGE = __doc__.split("\n\n")[1]


def _train(argv):
    from jrl.cli import train
    train.cli(argv)


def _plot(argv):
    from jrl.cli import plot
    return plot.main(argv)


def _convert(argv):
    from jrl.cli import convert
    return convert.main(argv)


def _local_cluster(argv):
    from jrl.cli import local_cluster
    return local_cluster.main(argv)


def _calibrate_tiles(argv):
    from jrl.cli import calibrate
    return calibrate.main(argv)


def _configs(argv):
    from jrl import configs
    if argv:
        print(f"jrl configs takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    for name in configs.names():
        print(name)
    return 0


def _device_check(argv):
    # The device check runs the test suite and the benchmarks, which a repository checkout has
    # and an installed package does not.
    if not os.path.isfile(os.path.join("launch", "device_check.py")):
        print("jrl device-check runs from a jrl repository checkout (it runs tests/ and the "
              "benchmarks in launch/); cd into one", file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())
    # The checkout's module, not a dependency of the package.
    device_check = importlib.import_module("launch.device_check")
    return device_check.main(argv)


COMMANDS = {"train": _train, "plot": _plot, "convert": _convert,
            "local-cluster": _local_cluster, "configs": _configs,
            "calibrate-tiles": _calibrate_tiles,
            "device-check": _device_check}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jrl COMMAND [ARGS ...]\n\n" + USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"jrl: unknown command {command!r}; allowed: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    return COMMANDS[command](rest) or 0


def entry() -> None:
    """The console script."""
    sys.exit(main())
