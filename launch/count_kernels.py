"""Kernels per layer of one exact decode step, in the programs lowered for CUDA and for TPU.

    python -m launch.count_kernels                 # table, and docs/results/kernel_counts.json
    python -m launch.count_kernels --out FILE
    python -m launch.count_kernels --render FILE   # a result's markdown table
    python -m launch.count_kernels --render FILE --before OLD   # OLD's counts -> FILE's

Nothing runs on an accelerator: the decode step (one token per slot, 8 slots, through the KV
cache, then the logits) of each model is traced on this CPU and lowered for the platform by
`jax.export`, as tests/models/test_gpu_lowering.py does. In its StableHLO, the layers run in one
`lax.scan` (a `stablehlo.while`), whose body is one period of the layer schedule: one layer of a
dense or MoE model, [3 x Gated DeltaNet, attention] of Qwen3.5. Counted in that body, through
every function it calls:
  pallas  the Pallas kernel calls (Triton on CUDA, Mosaic on TPU): each is a kernel launch;
  glue    every other op but constants and returns: the XLA work between the kernels (pads,
          casts, reshapes, selects, scatters, rotary tables, ...), which XLA fuses into some
          number of further kernels (the op count bounds it; XLA's fusion decides the rest);
  top     the most frequent glue ops.
Models: SmolLM2-135M (dense), Qwen3.5-0.8B (hybrid) and a Qwen3-MoE layer at SmolLM2's width
(8 experts, top-2), in bfloat16 with the platform's tiles (NumericalContract.for_platform).
A model whose TPU lowering asks for a TPU's properties (Mosaic's sublane count) cannot be
lowered for TPU on a CPU; its row says so.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re

import jax
import jax.numpy as jnp

from jrl.kernels import NumericalContract, _grid
from jrl.models import transformer
from jrl.models.config import ModelConfig

SLOTS, CAPACITY = 8, 128
PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "tpu_custom_call")
_TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w$.]+)\(", re.M)
_OP = re.compile(r"(?:=|^)\s*\"?([a-z_]+\.[a-z_]+)\b", re.M)
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call @([\w$.]+)")
_CUSTOM = re.compile(r"stablehlo\.custom_call @([\w$.]+)")
NOT_GLUE = {"stablehlo.constant", "stablehlo.return", "func.return", "func.call", "call",
            "stablehlo.custom_call"}


def models() -> dict[str, ModelConfig]:
    from launch.bench_e2e import SMOLLM2
    from launch.bench_qwen35 import QWEN35_08B
    moe = SMOLLM2.replace(model_type="qwen3_moe", qk_norm=True, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=768,
                          norm_topk_prob=True)
    return {"dense (SmolLM2-135M layer)": SMOLLM2,
            "hybrid (Qwen3.5-0.8B period: 3 Gated DeltaNet + 1 attention)": QWEN35_08B,
            "MoE (Qwen3-MoE layer, 8 experts top-2, SmolLM2 width)": moe}


def lowered_decode(config: ModelConfig, platform: str) -> str:
    """The StableHLO text of one decode step of `config` lowered for platform "gpu" / "tpu"."""
    previous = _grid._host_platform
    _grid._host_platform = lambda: platform     # the kernels pick their native lowering
    try:
        contract = NumericalContract.for_platform(platform, compute_dtype="bfloat16",
                                                  param_dtype="bfloat16")
        params = jax.eval_shape(lambda: transformer.init_params(
            config, jax.random.key(0), dtype=jnp.bfloat16))
        cache = jax.eval_shape(lambda: transformer.init_cache(config, SLOTS, CAPACITY, contract))

        def decode(p, token, position, c):
            hidden, c = transformer.forward_hidden(p, config, token, contract=contract,
                                                   positions=position, cache=c)
            return transformer.logits_from_hidden(p, hidden, contract=contract), c

        token = jax.ShapeDtypeStruct((SLOTS, 1), jnp.int32)
        exported = jax.export.export(
            jax.jit(decode), platforms=["cuda" if platform == "gpu" else "tpu"],
            disabled_checks=[_TRITON])(params, token, token, cache)
        return exported.mlir_module()
    finally:
        _grid._host_platform = previous


def _functions(text: str) -> dict[str, str]:
    """name -> body text of every func.func in a module."""
    bodies = {}
    for m in _FUNC.finditer(text):
        line_end = text.index("\n", m.end())
        bodies[m.group(1)] = _region(text, text.rindex("{", m.end(), line_end))
    return bodies


def _region(text: str, open_brace: int) -> str:
    """The text between the brace at open_brace and its match (braces inside string literals,
    such as a kernel's serialized IR, do not count)."""
    depth, i, in_string = 0, open_brace, False
    while i < len(text):
        char = text[i]
        if in_string:
            if char == "\\":
                i += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{}":
            depth += 1 if char == "{" else -1
            if depth == 0:
                return text[open_brace + 1:i]
        i += 1
    raise ValueError("unbalanced braces in the lowered module")


def count_region(text: str, functions: dict[str, str]) -> collections.Counter:
    """Ops in `text`, calls followed into their functions; Pallas calls as "pallas"."""
    counts: collections.Counter = collections.Counter()
    for line in text.splitlines():
        custom = _CUSTOM.search(line)
        if custom:
            counts["pallas" if custom.group(1) in PALLAS_TARGETS else
                   f"custom_call {custom.group(1)}"] += 1
            continue
        call = _CALL.search(line)
        if call:
            counts += count_region(functions[call.group(1)], functions)
            continue
        op = _OP.search(line)
        if op and op.group(1) not in NOT_GLUE:
            counts[op.group(1)] += 1
    return counts


def layer_counts(text: str) -> collections.Counter:
    """The op counts of the layer scan's body (the module's first `stablehlo.while`)."""
    functions = _functions(text)
    main = functions["main"]
    body_start = main.index("} do {", main.index("stablehlo.while")) + len("} do ")
    return count_region(_region(main, body_start), functions)


def summary(counts: collections.Counter) -> dict:
    glue = {op: n for op, n in counts.items() if op != "pallas"}
    return dict(pallas=counts["pallas"], glue=sum(glue.values()),
                top=dict(sorted(glue.items(), key=lambda kv: -kv[1])[:6]))


def render(result: dict) -> str:
    """The markdown table of a result file."""
    lines = [f"JAX {result['jax']}, commit {result['commit'][:10]}, {result['date']}; lowered on "
             f"a CPU; one decode step, {result['slots']} slots, "
             f"KV capacity {result['capacity']}, bfloat16, the platform's tiles.", "",
             "| layer | platform | Pallas calls | glue ops | most frequent glue ops |",
             "|---|---|---|---|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['platform']} | - | - | not lowered on a "
                         f"CPU: {row['error']} |")
            continue
        top = ", ".join(f"{op.split('.')[-1]} {n}" for op, n in row["top"].items())
        lines.append(f"| {row['model']} | {row['platform']} | {row['pallas']} | {row['glue']} | "
                     f"{top} |")
    return "\n".join(lines)


def render_change(before: dict, after: dict) -> str:
    """The markdown table of two results side by side (a change that fused kernels)."""
    lines = [f"Before: commit {before['commit'][:10]}; after: commit {after['commit'][:10]} "
             f"(JAX {after['jax']}); lowered on a CPU; one decode step, {after['slots']} slots, "
             f"KV capacity {after['capacity']}, bfloat16, the platform's tiles.", "",
             "| layer | platform | Pallas calls | glue ops |", "|---|---|---|---|"]
    old = {(row["model"], row["platform"]): row for row in before["rows"]}
    for row in after["rows"]:
        prior = old.get((row["model"], row["platform"]), {})
        if "error" in row or "error" in prior or not prior:
            lines.append(f"| {row['model']} | {row['platform']} | - | - |")
            continue
        lines.append(f"| {row['model']} | {row['platform']} | {prior['pallas']} -> "
                     f"{row['pallas']} | {prior['glue']} -> {row['glue']} "
                     f"({row['glue'] / prior['glue'] - 1:+.0%}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join("docs", "results", "kernel_counts.json"))
    parser.add_argument("--render", metavar="FILE", help="print FILE's markdown table and exit")
    parser.add_argument("--before", metavar="FILE",
                        help="with --render: a table of FILE's counts against this result's")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            after = json.load(f)
        if args.before:
            with open(args.before) as f:
                print(render_change(json.load(f), after))
        else:
            print(render(after))
        return
    rows = []
    for name, config in models().items():
        for platform in ("gpu", "tpu"):
            try:
                counted = summary(layer_counts(lowered_decode(config, platform)))
            except ValueError as err:
                # Mosaic asks the TPU for its sublane count at some block shapes; a CPU has
                # no TPU to ask (jax's "Unsupported TPU device kind: cpu").
                why = str(err).splitlines()[0]
                rows.append(dict(model=name, platform=platform, error=why))
                print(f"{name:<62} {platform}: not lowered here: {why}", flush=True)
                continue
            rows.append(dict(model=name, platform=platform, **counted))
            print(f"{name:<62} {platform}: {counted['pallas']:>3} Pallas calls, "
                  f"{counted['glue']:>4} glue ops; {counted['top']}", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        from launch.result_file import commit, machine
        json.dump(dict(tool="count_kernels", jax=jax.__version__, commit=commit(),
                       machine=machine(),
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                           timespec="seconds"),
                       slots=SLOTS, capacity=CAPACITY, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
