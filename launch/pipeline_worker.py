"""Multi-process worker for jrl.pipeline.loop.multihost: the train role on process 0 (Run's loop, the
link as its rollout source), the rollout role on process 1 (the server over the link). Launched through jrl.cli.local_cluster (tests/parallel/test_multihost_pipeline.py):

    python -m jrl.cli.local_cluster --processes 2 -- \
        python -m launch.pipeline_worker --config cfg.json --workdir /tmp/w --out /tmp/o

Each process writes <out>/<role>.json (everything but the params) and <out>/<role>_params.npz.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from jrl import logs
from jrl.parallel import distributed


def parity_reward(text, example) -> float:
    return float(len(text) % 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.pipeline_worker")
    parser.add_argument("--config", required=True, help="JSON of an RunConfig (to_dict)")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True, help="folder for <role>.json and params")
    parser.add_argument("--steps", type=int, default=None, help="run at most this many steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the train process's last checkpoint")
    parser.add_argument("--resume-step", type=int, default=None, metavar="N",
                        help="continue from checkpoint step N (implies --resume)")
    parser.add_argument("--overwrite", choices=("move", "delete"), default=None)
    parser.add_argument("--eval", action="store_true",
                        help="evaluate as the config says (default: eval.greedy and "
                             "eval.sampled off, so metrics.jsonl holds the trained steps only)")
    parser.add_argument("--reward", choices=["math", "parity"], default="math",
                        help="parity: reward = len(response text) % 2 (a test reward that "
                             "varies within groups)")
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure()      # the run's log lines on stdout, as `jrl train` shows them
    distributed.initialize_from_args(args)

    from launch.parallel_selftest import flatten
    from jrl.pipeline.config import config_from_dict
    from jrl.pipeline.loop.split_run import run_split_processes

    with open(args.config) as f:
        config = config_from_dict(json.load(f))
    if not args.eval:
        config = dataclasses.replace(config, eval=dataclasses.replace(
            config.eval, greedy=False, sampled=False))
    kwargs = {"reward_fn": parity_reward} if args.reward == "parity" else {}
    result = run_split_processes(config, args.workdir, steps=args.steps,
                                 resume=args.resume or args.resume_step is not None,
                                 resume_step=args.resume_step, overwrite=args.overwrite, **kwargs)
    os.makedirs(args.out, exist_ok=True)
    params = result.pop("params")
    np.savez(os.path.join(args.out, f"{result['role']}_params.npz"), **flatten(params))
    with open(os.path.join(args.out, f"{result['role']}.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    code = main()
    distributed.finish(code)   # the other process stops watching this one (or exits, on failure)
    sys.exit(code)
