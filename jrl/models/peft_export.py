"""LoRA adapters as a PEFT adapter directory: adapter_config.json + adapter_model.safetensors.

    save_peft(path, config, params, base_model_name_or_path="runs/base-hf")

PEFT's layout: one tensor pair per adapted module, named after the module in the transformers
model, `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]
(jrl's A [in, r] and B [r, out], transposed), scaled by lora_alpha / r. The module names come
from jrl.models.hf_checkpoint.tensor_specs (the names save_hf writes), so
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)` reproduces jrl's
adapted model (tests/models/test_lora.py). With QLoRA the adapters were trained on the
dequantised base (jrl.models.lora.dequantized_base): apply them to that base; a README.md
beside the adapter says so (quantized_base_note).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping

import jax
import numpy as np

from jrl import paths
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.models.hf_checkpoint import (_current_umask, _publish, _staging_directory, _write_text,
                                      tensor_specs)
from jrl.models.lora import base_config
from jrl.models.safetensors_io import write_safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_tensors(config: ModelConfig, params: Mapping) -> tuple[dict[str, np.ndarray], list[str]]:
    """({PEFT tensor name: array}, sorted target module names) of params' adapters."""
    if config.lora is None:
        raise ValueError("save_peft: the model has no adapters (model.lora.rank is 0)")
    specs = {spec.param_path: spec for spec in tensor_specs(base_config(config))}
    tensors: dict[str, np.ndarray] = {}
    targets: set[str] = set()
    for key, names in transformer.lora_weights(config).items():
        for name in names:
            spec = specs[(key, name)]
            a = np.asarray(jax.device_get(params[key][name + "_lora_a"]), np.float32)
            b = np.asarray(jax.device_get(params[key][name + "_lora_b"]), np.float32)
            for index, layer in enumerate(spec.layers):
                module = spec.hf_name.format(layer=layer)
                if not module.endswith(".weight"):
                    raise ValueError(f"save_peft: {module} is not a Linear weight")
                module = module[:-len(".weight")]
                targets.add(module.rsplit(".", 1)[-1])
                tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a[index].T)
                tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b[index].T)
    return tensors, sorted(targets)


def adapter_config(config: ModelConfig, targets: list[str],
                   base_model_name_or_path: str | None) -> dict[str, Any]:
    lora = config.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "base_model_name_or_path": base_model_name_or_path, "modules_to_save": None,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "revision": None}


ADAPTER_README = "README.md"
_QUANTIZATION = {"int8": "int8 with one float32 scale per output channel",
                 "nf4": "4-bit NormalFloat (NF4) in blocks of 64 with a float32 scale each"}


def quantized_base_note(config: ModelConfig) -> str | None:
    """What a QLoRA run's adapters were trained against (None without quantisation): the base's
    projections stored quantised and dequantised in the kernel, not the float base that
    base_model_name_or_path names."""
    fmt = config.lora.quantize if config.lora is not None else "none"
    if fmt == "none":
        return None
    return (f"These adapters were trained (QLoRA) against the base model with its projections "
            f"quantised as {_QUANTIZATION[fmt]} and dequantised to float32 in each matmul "
            f"(jrl.kernels.quantized). Applied to the float base they approximate the trained "
            f"policy; for its exact weights apply them to the dequantised base "
            f"(jrl.models.lora.dequantized_base), or export the merged model with --export-hf.")


def save_peft(path: str | os.PathLike, config: ModelConfig, params: Mapping, *,
              base_model_name_or_path: str | None = None, overwrite: bool = False) -> None:
    """Writes the PEFT adapter directory `path` (float32 tensors) in one atomic step: a
    temporary sibling directory renamed into place, as save_hf does (a URL: uploaded)."""
    target = paths.resolve(path)
    if paths.exists(target) and (not paths.isdir(target) or paths.listdir(target)) \
            and not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; pass overwrite=True to "
                              "replace it")
    tensors, targets = peft_tensors(config, params)
    staging = _staging_directory(target)
    try:
        os.chmod(staging, 0o777 & ~_current_umask())
        write_safetensors(os.path.join(staging, ADAPTER_WEIGHTS), tensors,
                          metadata={"format": "pt"})
        _write_text(os.path.join(staging, ADAPTER_CONFIG),
                    json.dumps(adapter_config(config, targets, base_model_name_or_path),
                               indent=2))
        note = quantized_base_note(config)
        if note is not None:
            # Beside adapter_config.json, which holds PEFT's own fields only.
            _write_text(os.path.join(staging, ADAPTER_README),
                        "# QLoRA adapters\n\n" + note + "\n")
        _publish(staging, target, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
