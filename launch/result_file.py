"""What every benchmark's JSON result file records beside its figures: the machine and the
commit (jrl's figures are data: docs tables are rendered from these files)."""

from __future__ import annotations

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
