"""Measure the CPU matmul row tiles of a config: jrl calibrate-tiles --config NAME --out FILE.

On a CPU the batch-invariant matmul runs matmul_block_m rows per library dot unless the
contract's matmul_row_tiles allows other row counts for a shape (a decode step of few slots
pads less on narrower tiles, a train step of many rows packs the weights less often on wider
ones). Whether another row count rounds like block_m rows is a property of this CPU's math
library, so it is measured here, never guessed while a program is traced:

1. one RL step of the config runs in a scratch directory, recording the (K, N) of every
   matmul its programs trace (sampler, train step, evaluation);
2. each candidate tile of each shape runs beside block_m-row tiles on random operands, and
   the tiles whose bits agree enter the table (jrl.kernels.matmul.calibrate_row_tiles);
3. the config, with its contract resolved for this machine and the table in
   numerics.matmul_row_tiles, is written as JSON: `jrl train --config FILE` runs it.

--check FILE verifies the table of a config written before (on another machine, say): exit
status 1 and one line per tile this machine rounds differently.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jrl calibrate-tiles", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", required=True,
                        help="a shipped config's name, a Python config file or a config JSON")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, as for jrl train (repeatable)")
    parser.add_argument("--out", help="where to write the calibrated config (JSON)")
    parser.add_argument("--check", action="store_true",
                        help="verify the config's numerics.matmul_row_tiles on this machine "
                             "instead of measuring a new table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from jrl.cli.train import load_config
    from jrl.kernels.matmul import check_row_tiles
    try:
        config = load_config(args.config, args.set)
    except (OSError, ValueError) as err:
        print(f"jrl calibrate-tiles: {err}", file=sys.stderr)
        return 2
    contract = config.numerics.resolved_for()
    if args.check:
        wrong = check_row_tiles(contract)
        for line in wrong:
            print(line)
        entries = len(contract.matmul_row_tiles)
        print(f"{entries} table entries checked: "
              + ("all hold on this machine" if not wrong else f"{len(wrong)} tiles differ"))
        return 1 if wrong else 0
    if not args.out:
        print("jrl calibrate-tiles: --out FILE is required (or --check)", file=sys.stderr)
        return 2
    if contract.backend != "pallas" or contract.resolved_platform() != "cpu":
        print(f"jrl calibrate-tiles: numerics.backend={contract.backend!r} on "
              f"{contract.resolved_platform()!r} has no CPU row tiles to measure (the table is "
              "for the Pallas kernels' emulated grid on a CPU)", file=sys.stderr)
        return 2
    table = calibrate(config)
    calibrated = dataclasses.replace(
        config, numerics=contract.replace(matmul_row_tiles=table))
    from jrl.pipeline.config.tools import to_dict
    with open(args.out, "w") as f:
        json.dump(to_dict(calibrated), f, indent=1)
    print(f"{len(table)} shapes with other row tiles than {contract.matmul_block_m}; "
          f"wrote {args.out} (jrl train --config {args.out})")
    return 0


def calibrate(config) -> tuple[tuple[int, ...], ...]:
    """The matmul_row_tiles table of `config` on this machine: the shapes one RL step traces,
    each with the row tiles that round like matmul_block_m rows here."""
    from jrl.kernels.matmul import calibrate_row_tiles, recording_shapes
    from jrl.pipeline.loop.runner import Run
    contract = config.numerics.resolved_for().replace(matmul_row_tiles=())
    config = dataclasses.replace(config, numerics=contract)
    with tempfile.TemporaryDirectory() as workdir, recording_shapes() as shapes:
        run = Run(config, workdir, log=lambda line: None, write_metrics=False)
        try:
            run.run(steps=1)
        finally:
            run.close()
    return calibrate_row_tiles(contract, shapes)


if __name__ == "__main__":
    sys.exit(main())
