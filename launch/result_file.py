"""What every benchmark's JSON result file records beside its figures: the machine and the
commit (jrl's figures are data: docs tables are rendered from these files)."""

from __future__ import annotations

import json
import os
import platform
import subprocess

import jax


def machine() -> dict:
    """What a result file says of the machine: platform, devices, CPU model and cores."""
    return dict(platform=jax.default_backend(), devices=[d.device_kind for d in jax.devices()],
                cpu_count=os.cpu_count(), processor=platform.processor() or platform.machine(),
                cpu_model=_cpu_model(), python=platform.python_version(), jax=jax.__version__)


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def commit() -> str:
    """The checkout's HEAD commit, or "" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def ratio_table(rows: list[dict], key: str, unit: str, digits: int) -> list[str]:
    """Markdown lines of a result file's exact-against-XLA rows: row[key], row["pallas"],
    row["xla"] (each `digits` decimals) and row["pallas_over_xla_speed"]."""
    lines = [f"| {key} | exact (Pallas){unit} | XLA{unit} | exact / XLA speed |",
             "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row[key]} | {row['pallas']:.{digits}f} | {row['xla']:.{digits}f} | "
                     f"{row['pallas_over_xla_speed']:.2f}x |")
    return lines


def write_result(result: dict, name: str, render, out: str | None = None) -> str:
    """Write `result` as JSON to `out` (default docs/results/<name>_<platform>.json under the
    repository), print render(result) and the path; returns the path."""
    out = out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "docs", "results", f"{name}_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result))
    print(f"wrote {out}")
    return out


def add_result_arguments(parser) -> None:
    """A benchmark's --render FILE (print a result file's tables and exit) and --out FILE."""
    parser.add_argument("--render", metavar="FILE", help="print FILE's markdown tables and exit")
    parser.add_argument("--out", default=None, help="the result file (default docs/results/)")


def rendered(args, render) -> bool:
    """Print render(result) of --render FILE; whether there was one (the caller then exits)."""
    if not args.render:
        return False
    with open(args.render) as f:
        print(render(json.load(f)))
    return True
