"""The end of a run in one file: summary.json, and the model card of an exported policy.

summary.json (written by Run at the end of every run() call, resumes included) reads the run's
metrics.jsonl, the durable record across resumes, so it covers the whole run:

    {"name", "steps", "wall_s" (this call's), "first_eval" {"step", eval/*},
     "last_eval" {...}, "best_eval" {...} (the highest eval/accuracy, earliest on ties),
     "recipe" (its repr: advantages, loss chain, shaping), "contract" (the resolved
     NumericalContract), "model" {"source", "path", "model_type"}}

`model_card` turns it into the README.md that --export-hf writes beside the weights.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jrl import paths
from jrl.metrics import names
from jrl.pipeline.config import RunConfig
from jrl.pipeline.config.tools import to_dict

SUMMARY_FILE = "summary.json"


def eval_records(metrics_path: str) -> list[dict]:
    """The records of metrics.jsonl that hold an evaluation: {"step", eval/* ...} each, in step
    order (a line cut short by a crash is skipped)."""
    records = []
    if not paths.exists(metrics_path):
        return records
    with paths.open_file(metrics_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            evals = {k: v for k, v in record.items() if k.startswith("eval/")}
            if names.EVAL_ACCURACY in evals:
                records.append({"step": record["step"], **evals})
    return sorted(records, key=lambda r: r["step"])


def run_summary(config: RunConfig, metrics_path: str, *, steps: int, wall_s: float,
                model_type: str) -> dict:
    """The summary.json record of a run (see the module doc)."""
    evals = eval_records(metrics_path)
    best = max(evals, key=lambda r: (r[names.EVAL_ACCURACY], -r["step"])) if evals else None
    return {
        "name": config.name,
        "steps": steps,
        "wall_s": round(wall_s, 3),
        "first_eval": evals[0] if evals else None,
        "last_eval": evals[-1] if evals else None,
        "best_eval": best,
        "recipe": repr(config.recipe()),
        "contract": to_dict(config.numerics),
        "model": {"source": config.model.source, "path": config.model.path,
                  "model_type": model_type},
    }


def write_summary(workdir: str, summary: dict) -> str:
    """summary.json in workdir (a local path or a URL), written atomically; returns its path."""
    path = os.path.join(workdir, SUMMARY_FILE)
    paths.write_text_atomic(path, json.dumps(summary, indent=1))
    return path


def model_card(summary: dict, *, model_type: str, base_model: str | None) -> str:
    """README.md for an exported policy: what it is, how it was trained, and its evaluation."""
    lines = ["---", "library_name: transformers", "tags:", "- jrl", "- reinforcement-learning"]
    if base_model:
        lines.append(f"base_model: {os.path.basename(os.path.normpath(base_model))}")
    lines += ["---", "", f"# {summary['name']}", "",
              f"A `{model_type}` policy trained by reinforcement learning with jrl (a JAX RL "
              "trainer whose sampler's log-probabilities equal the trainer's bit for bit).", ""]
    lines += ["## Training", "", f"- base: {base_model or 'a random initialisation'}",
              f"- RL steps: {summary['steps']}", f"- recipe: `{summary['recipe']}`",
              f"- numerical contract: backend {summary['contract']['backend']}, compute "
              f"{summary['contract']['compute_dtype']}, params "
              f"{summary['contract']['param_dtype']}", ""]
    rows = [("first", summary["first_eval"]), ("best", summary["best_eval"]),
            ("last", summary["last_eval"])]
    rows = [(label, record) for label, record in rows if record]
    if rows:
        keys = sorted({k for _, record in rows for k in record if k.startswith("eval/")
                       and isinstance(record[k], (int, float))})
        lines += ["## Evaluation", "", "| | step | " + " | ".join(keys) + " |",
                  "|---|---|" + "---|" * len(keys)]
        for label, record in rows:
            cells = [_cell(record.get(k)) for k in keys]
            lines.append(f"| {label} | {record['step']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
