"""Hugging Face checkpoints: config.json <-> ModelConfig, safetensors <-> the jrl param pytree.

HF stores one tensor per layer as [out, in] (torch Linear); jrl stores [in, out] with the layers
stacked on a leading axis L (see jrl.models.transformer). Loading validates every tensor (a
missing, unexpected or wrongly shaped tensor raises an error naming it); saving writes to a
temporary directory and renames it into place, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from jrl.models.config import MODEL_TYPES, ModelConfig
from jrl.models.safetensors_io import SafetensorsFile, plan_shards, write_safetensors

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024 ** 3

ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MODEL_TYPE_OF_ARCHITECTURE = {arch: mt for mt, arch in ARCHITECTURE_OF_MODEL_TYPE.items()}

# Defaults of the transformers config classes, used when config.json omits an optional field
# (this is what transformers itself would use for the same file).
_HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
}

HF_DTYPES = ("float32", "bfloat16", "float16")

# Tensors some checkpoints carry that hold no weights (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------------
# config.json


def _require(config_json: Mapping, key: str) -> Any:
    if config_json.get(key) is None:
        raise ValueError(f"config.json: required field {key!r} is missing")
    return config_json[key]


def hf_model_type(config_json: Mapping) -> str:
    """The model_type of an HF config, checked against the supported families."""
    model_type = config_json.get("model_type")
    architectures = config_json.get("architectures") or []
    if model_type is None:
        known = [MODEL_TYPE_OF_ARCHITECTURE[a] for a in architectures
                 if a in MODEL_TYPE_OF_ARCHITECTURE]
        if not known:
            raise ValueError(f"config.json: no model_type and unsupported architectures "
                             f"{architectures}; supported: {sorted(MODEL_TYPE_OF_ARCHITECTURE)}")
        model_type = known[0]
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: unsupported model_type {model_type!r} (architectures "
                         f"{architectures}); supported: {list(MODEL_TYPES)}")
    expected_arch = ARCHITECTURE_OF_MODEL_TYPE[model_type]
    for arch in architectures:
        if arch != expected_arch:
            raise ValueError(f"config.json: architecture {arch!r} is not supported for "
                             f"model_type {model_type!r}; supported: [{expected_arch!r}] "
                             "(a causal LM with an lm_head)")
    return model_type


def hf_dtype(config_json: Mapping) -> str | None:
    """The checkpoint dtype named by `dtype` (transformers >= 4.56) or `torch_dtype`, or None."""
    value = config_json.get("dtype", config_json.get("torch_dtype"))
    if value is None:
        return None
    if value not in HF_DTYPES:
        raise ValueError(f"config.json: dtype {value!r} is not supported; allowed: "
                         f"{list(HF_DTYPES)}")
    return value


def _rope_theta(config_json: Mapping, model_type: str) -> float:
    """rope_theta from either style (top-level, or transformers 5's rope_parameters).

    Only unscaled RoPE is supported: any rope_scaling / rope_parameters type other than
    "default" raises, as does partial rotary.
    """
    for field in ("rope_scaling", "rope_parameters"):
        block = config_json.get(field)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise ValueError(f"config.json: {field}={block!r} must be an object or null")
        if any(isinstance(v, Mapping) for v in block.values()):
            raise ValueError(f"config.json: {field} is given per layer type ({sorted(block)}); "
                             "jrl supports one unscaled RoPE for all layers")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json: unsupported rope_scaling type {rope_type!r} (in "
                             f"{field}); jrl supports only unscaled RoPE ('default')")
        factor = block.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise ValueError(f"config.json: {field}.partial_rotary_factor={factor}; jrl "
                             "supports only full rotary embeddings (1.0)")
    if config_json.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor="
                         f"{config_json['partial_rotary_factor']}; jrl supports only 1.0")
    top = config_json.get("rope_theta")
    nested = (config_json.get("rope_parameters") or {}).get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise ValueError(f"config.json: rope_theta={top} disagrees with "
                         f"rope_parameters.rope_theta={nested}")
    theta = nested if nested is not None else top
    return float(theta if theta is not None else _HF_DEFAULTS[model_type]["rope_theta"])


def config_from_hf(config_json: Mapping) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (Llama, Qwen2, Qwen3).

    Qwen2 always has q/k/v biases; Qwen3 always has per-head q/k RMSNorm. Features outside the
    jrl parameter layout (o_proj / MLP biases, sliding-window layers, scaled RoPE, activations
    other than SiLU) raise a ValueError naming the field.
    """
    model_type = hf_model_type(config_json)
    defaults = _HF_DEFAULTS[model_type]
    hf_dtype(config_json)  # validates the field if present
    hidden_act = config_json.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config.json: hidden_act={hidden_act!r}; jrl supports only 'silu'")
    if config_json.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true; jrl's MLP has no biases")
    if config_json.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true; jrl supports only full attention")
    layer_types = config_json.get("layer_types") or []
    other_layers = sorted({t for t in layer_types if t != "full_attention"})
    if other_layers:
        raise ValueError(f"config.json: layer_types contains {other_layers}; jrl supports only "
                         "'full_attention'")

    if model_type == "qwen2":
        attention_bias = True  # Qwen2 q/k/v projections always carry a bias (o_proj never does)
    else:
        attention_bias = bool(config_json.get("attention_bias", False))
        if attention_bias:
            raise ValueError(f"config.json: attention_bias=true for model_type {model_type!r} "
                             "also puts a bias on o_proj, which jrl's parameter layout does not "
                             "have; supported: attention_bias=false (Qwen2 q/k/v biases are "
                             "supported)")

    hidden_size = int(_require(config_json, "hidden_size"))
    num_heads = int(_require(config_json, "num_attention_heads"))
    num_kv_heads = config_json.get("num_key_value_heads")
    head_dim = config_json.get("head_dim")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"config.json: head_dim is missing and hidden_size={hidden_size} is "
                             f"not divisible by num_attention_heads={num_heads}")
        head_dim = hidden_size // num_heads
    eos = config_json.get("eos_token_id")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(config_json, "vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(_require(config_json, "intermediate_size")),
        num_layers=int(_require(config_json, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads if num_kv_heads is not None else num_heads),
        head_dim=int(head_dim),
        rope_theta=_rope_theta(config_json, model_type),
        rms_norm_eps=float(config_json.get("rms_norm_eps", defaults["rms_norm_eps"])),
        tie_word_embeddings=bool(config_json.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(config_json.get("max_position_embeddings",
                                                    defaults["max_position_embeddings"])),
        bos_token_id=config_json.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )


def _normalize_dtype_name(dtype: Any) -> str:
    name = jnp.dtype(dtype).name
    if name not in HF_DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed checkpoint dtypes are {list(HF_DTYPES)}")
    return name


def _check_hf_expressible(config: ModelConfig) -> None:
    if config.model_type == "qwen2" and not config.attention_bias:
        raise ValueError("ModelConfig(model_type='qwen2', attention_bias=False) has no HF "
                         "equivalent: Qwen2 always has q/k/v biases")
    if config.model_type != "qwen2" and config.attention_bias:
        raise ValueError(f"ModelConfig(model_type={config.model_type!r}, attention_bias=True) "
                         "has no HF equivalent: HF's attention_bias also biases o_proj")
    if config.qk_norm != (config.model_type == "qwen3"):
        raise ValueError(f"ModelConfig(model_type={config.model_type!r}, "
                         f"qk_norm={config.qk_norm}) has no HF equivalent: only Qwen3 (always) "
                         "has q/k norms")


def config_to_hf(config: ModelConfig, dtype: Any) -> dict:
    """The HF config.json dict for `config`, with weights stored in `dtype`.

    Writes rope_theta both top-level (transformers < 5) and in rope_parameters (transformers 5),
    and the dtype under both `torch_dtype` and `dtype`.
    """
    _check_hf_expressible(config)
    dtype_name = _normalize_dtype_name(dtype)
    eos = config.eos_token_id
    out = {
        "architectures": [ARCHITECTURE_OF_MODEL_TYPE[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if config.model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=config.num_layers)
        if config.model_type == "qwen3":
            out["attention_bias"] = False
    return out


# ------------------------------------------------------------------------------------------------
# tensor layout


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One jrl param and its HF tensor(s).

    param_path: keys into the param pytree, e.g. ("layers", "wq").
    hf_name: HF tensor name; contains "{layer}" for per-layer tensors.
    hf_shape: shape of one HF tensor ([out, in] for Linear weights).
    transpose: the jrl param stores the transposed matrix ([in, out]).
    """

    param_path: tuple[str, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    transpose: bool = False

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf_name

    def hf_names(self, num_layers: int) -> list[str]:
        if not self.per_layer:
            return [self.hf_name]
        return [self.hf_name.format(layer=i) for i in range(num_layers)]

    def param_shape(self, num_layers: int) -> tuple[int, ...]:
        shape = self.hf_shape[::-1] if self.transpose else self.hf_shape
        return ((num_layers,) + shape) if self.per_layer else shape


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every param of `config` with its HF name and shape, in HF checkpoint order."""
    d, f, v, hd = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    layer = "model.layers.{layer}."
    specs = [TensorSpec(("embed",), "model.embed_tokens.weight", (v, d))]
    specs.append(TensorSpec(("layers", "attn_norm"), layer + "input_layernorm.weight", (d,)))
    specs += [
        TensorSpec(("layers", "wq"), layer + "self_attn.q_proj.weight", (q, d), True),
        TensorSpec(("layers", "wk"), layer + "self_attn.k_proj.weight", (kv, d), True),
        TensorSpec(("layers", "wv"), layer + "self_attn.v_proj.weight", (kv, d), True),
    ]
    if config.attention_bias:
        specs += [
            TensorSpec(("layers", "bq"), layer + "self_attn.q_proj.bias", (q,)),
            TensorSpec(("layers", "bk"), layer + "self_attn.k_proj.bias", (kv,)),
            TensorSpec(("layers", "bv"), layer + "self_attn.v_proj.bias", (kv,)),
        ]
    if config.qk_norm:
        specs += [
            TensorSpec(("layers", "q_norm"), layer + "self_attn.q_norm.weight", (hd,)),
            TensorSpec(("layers", "k_norm"), layer + "self_attn.k_norm.weight", (hd,)),
        ]
    specs += [
        TensorSpec(("layers", "wo"), layer + "self_attn.o_proj.weight", (d, q), True),
        TensorSpec(("layers", "mlp_norm"), layer + "post_attention_layernorm.weight", (d,)),
        TensorSpec(("layers", "w_gate"), layer + "mlp.gate_proj.weight", (f, d), True),
        TensorSpec(("layers", "w_up"), layer + "mlp.up_proj.weight", (f, d), True),
        TensorSpec(("layers", "w_down"), layer + "mlp.down_proj.weight", (d, f), True),
        TensorSpec(("final_norm",), "model.norm.weight", (d,)),
    ]
    if not config.tie_word_embeddings:
        specs.append(TensorSpec(("lm_head",), "lm_head.weight", (v, d), True))
    return specs


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_path(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            raise ValueError(f"params: missing params{''.join(f'[{k!r}]' for k in path)}")
        tree = tree[key]
    return tree


def _flatten_paths(tree: Mapping, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten_paths(value, prefix + (key,))
        else:
            yield prefix + (key,)


# ------------------------------------------------------------------------------------------------
# loading


class _TensorSource:
    """All tensors of an HF directory (single file or sharded with an index), by name."""

    def __init__(self, directory: str):
        single = os.path.join(directory, SINGLE_FILE)
        index = os.path.join(directory, INDEX_FILE)
        self.files: dict[str, SafetensorsFile] = {}
        self.file_of: dict[str, str] = {}
        if os.path.exists(index):
            with open(index) as handle:
                weight_map = json.load(handle).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: missing or malformed 'weight_map'")
            for filename in sorted(set(weight_map.values())):
                path = os.path.join(directory, filename)
                if not os.path.exists(path):
                    raise FileNotFoundError(f"{index} names shard {filename!r}, which does not "
                                            "exist")
                self.files[filename] = SafetensorsFile(path)
            for name, filename in weight_map.items():
                if name not in self.files[filename]:
                    raise ValueError(f"{index} maps tensor {name!r} to {filename!r}, which does "
                                     "not contain it")
                self.file_of[name] = filename
        elif os.path.exists(single):
            self.files[SINGLE_FILE] = SafetensorsFile(single)
            self.file_of = {name: SINGLE_FILE for name in self.files[SINGLE_FILE].names()}
        else:
            present = sorted(os.listdir(directory))
            raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found "
                                    f"(files: {present}); only safetensors checkpoints are "
                                    "supported")

    def names(self) -> set[str]:
        return set(self.file_of)

    def describe(self, name: str) -> str:
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.file_of[name]].shapes[name]

    def read(self, name: str) -> np.ndarray:
        return self.files[self.file_of[name]].read(name)


def read_hf_config(path: str | os.PathLike) -> dict:
    config_path = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE}; not a Hugging Face checkpoint "
                                "directory")
    with open(config_path) as handle:
        return json.load(handle)


def _shown(names: list[str], limit: int = 8) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def validate_and_convert(source, config: ModelConfig, specs: list[TensorSpec], where: str, *,
                         dtype: Any = None) -> dict:
    """Checks that `source` holds exactly the tensors of `config` and converts them to params.

    source: names() -> set of HF tensor names, shape(name), read(name) -> numpy array [out, in],
      describe(name) -> the name to print in errors.
    Raises ValueError naming a missing tensor, a wrong shape (expected and found) or tensors the
    layout has no place for. Returns the params pytree (jnp arrays in `dtype`, or the stored
    dtype when dtype is None).
    """
    expected: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        for name in spec.hf_names(config.num_layers):
            expected[name] = spec.hf_shape
    present = source.names()
    missing = [source.describe(name) for name in expected if name not in present]
    if missing:
        raise ValueError(f"{where}: missing tensor(s) {_shown(missing)} required by the "
                         f"{config.model_type} config")
    for name, shape in expected.items():
        found = source.shape(name)
        if found != shape:
            raise ValueError(f"{where}: tensor {source.describe(name)} has shape {list(found)}, "
                             f"expected {list(shape)} from the config")
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(source.describe(name) for name in present - set(expected) - allowed_extra
                        if not name.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor(s) {_shown(unexpected)}: jrl's "
                         f"{config.model_type} layout has no place for them (refusing to drop "
                         "weights silently)")
    if config.tie_word_embeddings and "lm_head.weight" in present:
        lm_head = source.read("lm_head.weight")
        embed = source.read("model.embed_tokens.weight")
        if lm_head.shape != embed.shape or not np.array_equal(lm_head, embed):
            raise ValueError(f"{where}: tie_word_embeddings=true but lm_head.weight differs from "
                             "model.embed_tokens.weight; set tie_word_embeddings=false to load "
                             "them separately")

    target = None if dtype is None else jnp.dtype(dtype)

    def convert(array: np.ndarray, transpose: bool) -> np.ndarray:
        array = array.T if transpose else array
        return array.astype(target) if target is not None else array

    params: dict = {}
    for spec in specs:
        pieces = [convert(source.read(name), spec.transpose)
                  for name in spec.hf_names(config.num_layers)]
        stacked = np.stack(pieces) if spec.per_layer else np.array(pieces[0], order="C")
        _set_path(params, spec.param_path, jnp.asarray(stacked))
    return params


def load_hf(path: str | os.PathLike, *, dtype: Any = None) -> tuple[ModelConfig, dict]:
    """Loads an HF directory (config.json + model.safetensors or a sharded index).

    Args:
      path: the checkpoint directory.
      dtype: dtype of the returned params; None keeps each tensor's stored dtype (so a bfloat16
        checkpoint loads as bfloat16, bit for bit).
    Returns:
      (config, params): params in the jrl layout (see jrl.models.transformer), jnp arrays.
    """
    directory = os.fspath(path)
    config = config_from_hf(read_hf_config(directory))
    source = _TensorSource(directory)
    params = validate_and_convert(source, config, tensor_specs(config), directory, dtype=dtype)
    return config, params


# ------------------------------------------------------------------------------------------------
# saving


def _validate_params(config: ModelConfig, params: Mapping, specs: list[TensorSpec]) -> None:
    expected_paths = {spec.param_path for spec in specs}
    unexpected = sorted(set(_flatten_paths(params)) - expected_paths)
    if unexpected:
        raise ValueError(f"params: unexpected entries {['/'.join(p) for p in unexpected]} for "
                         f"this config (attention_bias={config.attention_bias}, "
                         f"qk_norm={config.qk_norm}, "
                         f"tie_word_embeddings={config.tie_word_embeddings})")
    for spec in specs:
        value = _get_path(params, spec.param_path)
        expected = spec.param_shape(config.num_layers)
        if tuple(value.shape) != expected:
            raise ValueError(f"params/{'/'.join(spec.param_path)} has shape {list(value.shape)}, "
                             f"expected {list(expected)}")


def _hf_tensors(config: ModelConfig, params: Mapping, specs: list[TensorSpec],
                dtype: np.dtype) -> Iterator[tuple[str, Callable[[], np.ndarray], int]]:
    """(hf name, thunk producing the HF tensor, its size in bytes), in checkpoint order."""
    per_layer = [s for s in specs if s.per_layer]
    before = [s for s in specs if not s.per_layer and s.param_path == ("embed",)]
    after = [s for s in specs if not s.per_layer and s.param_path != ("embed",)]
    host: dict[tuple[str, ...], np.ndarray] = {}

    def host_array(path):
        if path not in host:
            host[path] = np.asarray(_get_path(params, path))
        return host[path]

    def make(spec: TensorSpec, layer: int | None):
        def thunk():
            array = host_array(spec.param_path)
            array = array[layer] if layer is not None else array
            array = array.T if spec.transpose else array
            return np.ascontiguousarray(array.astype(dtype))
        return thunk

    nbytes = lambda spec: int(np.prod(spec.hf_shape)) * dtype.itemsize
    for spec in before:
        yield spec.hf_name, make(spec, None), nbytes(spec)
    for layer in range(config.num_layers):
        for spec in per_layer:
            yield spec.hf_name.format(layer=layer), make(spec, layer), nbytes(spec)
    for spec in after:
        yield spec.hf_name, make(spec, None), nbytes(spec)


def _check_file_name(name: str) -> None:
    if not name or os.path.basename(name) != name or name in (".", ".."):
        raise ValueError(f"extra_files: {name!r} must be a plain file name (no directories)")


def save_hf(path: str | os.PathLike, config: ModelConfig, params: Mapping, *, dtype: Any,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
            extra_files: Mapping[str, str | bytes] | None = None) -> None:
    """Writes an HF directory: config.json + model.safetensors (or shards + index).

    Args:
      path: the directory to create. It must not exist (or be empty) unless overwrite=True.
      config, params: the model, params in the jrl layout.
      dtype: dtype of the stored tensors ("float32", "bfloat16" or "float16").
      max_shard_bytes: above this total size the tensors are split into
        model-0000i-of-0000n.safetensors files with a model.safetensors.index.json.
      overwrite: replace an existing checkpoint at `path`.
      extra_files: file name -> contents (e.g. tokenizer.json), written in the same atomic step.
    Everything is written to a temporary sibling directory, fsynced and renamed into place, so
    `path` holds either the old checkpoint or the complete new one, never a partial one.
    """
    target = os.path.abspath(os.fspath(path))
    dtype_name = _normalize_dtype_name(dtype)
    np_dtype = np.dtype(jnp.dtype(dtype_name))
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be positive")
    for name in extra_files or {}:
        _check_file_name(name)

    def occupied() -> bool:
        return os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target))

    if occupied() and not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; pass overwrite=True to "
                              "replace it")
    specs = tensor_specs(config)
    hf_config = config_to_hf(config, dtype_name)
    _validate_params(config, params, specs)

    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)
    try:
        os.chmod(staging, 0o777 & ~_current_umask())  # mkdtemp makes it private (0700)
        tensors = list(_hf_tensors(config, params, specs, np_dtype))
        shards = plan_shards([(name, size) for name, _, size in tensors], max_shard_bytes)
        thunks = {name: thunk for name, thunk, _ in tensors}
        metadata = {"format": "pt"}
        if len(shards) == 1:
            write_safetensors(os.path.join(staging, SINGLE_FILE),
                              {name: thunks[name]() for name in shards[0]}, metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(os.path.join(staging, filename),
                                  {name: thunks[name]() for name in shard}, metadata=metadata)
                weight_map.update({name: filename for name in shard})
            index = {"metadata": {"total_size": sum(size for _, _, size in tensors)},
                     "weight_map": weight_map}
            _write_text(os.path.join(staging, INDEX_FILE), json.dumps(index, indent=2))
        _write_text(os.path.join(staging, CONFIG_FILE), json.dumps(hf_config, indent=2))
        for name, contents in (extra_files or {}).items():
            _write_text(os.path.join(staging, name), contents)
        _publish(staging, target, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_text(path: str, contents: str | bytes) -> None:
    data = contents.encode("utf-8") if isinstance(contents, str) else contents
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _publish(staging: str, target: str, *, overwrite: bool) -> None:
    """Renames the finished staging directory to target (replacing an old one if allowed)."""
    if os.path.isdir(target) and not os.listdir(target):
        os.rmdir(target)
    if os.path.exists(target):
        if not overwrite:
            raise FileExistsError(f"{target} appeared while saving; pass overwrite=True")
        retired = f"{target}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, retired)
        os.rename(staging, target)
        shutil.rmtree(retired)
    else:
        os.rename(staging, target)
    directory_fd = os.open(os.path.dirname(target), os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
