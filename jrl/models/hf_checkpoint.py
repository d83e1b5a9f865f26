"""Hugging Face checkpoints: safetensors <-> the jrl param pytree (config.json: hf_config.py).

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
import sys
import tempfile
import uuid
from typing import Any, Callable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from jrl import paths
from jrl.models import mtp
from jrl.models.config import KIND_PARAM_KEYS, ModelConfig
from jrl.models.hf_config import (config_from_hf, config_to_hf, normalize_dtype_name,
                                 text_config)
from jrl.models.safetensors_io import SafetensorsFile, plan_shards, write_safetensors

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024 ** 3

# Tensors some checkpoints carry that hold no weights (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------------
# tensor layout


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One jrl param and the HF tensor(s) it comes from.

    param_path: keys into the param pytree, e.g. ("layers", "wq").
    hf_name: HF tensor name; "{layer}" for per-layer tensors, "{expert}" for per-expert ones.
    hf_shape: shape of one HF tensor ([out, in] for Linear weights).
    transpose: the jrl param stores the HF tensor with its last two axes swapped ([in, out]).
    layers: the global layer indices whose tensors are stacked (in order) on the param's
      leading axis; () for tensors outside the layers.
    experts: > 0: one HF tensor per expert, stacked on the axis after the layer axis.
    part: (i, n): the param is the i-th of n equal slices of the HF tensor along part_axis
      (transformers 5's fused experts.gate_up_proj holds gate and up).
    conv: the HF tensor is a depthwise Conv1d weight [channels, 1, K], stored [K, channels].
    """

    param_path: tuple[str, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    transpose: bool = False
    layers: tuple[int, ...] = ()
    experts: int = 0
    part: tuple[int, int] | None = None
    part_axis: int = 0
    conv: bool = False

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf_name

    def hf_names(self) -> list[str]:
        layers = self.layers if self.per_layer else (None,)
        experts = range(self.experts) if self.experts else (None,)
        return [self.hf_name.format(layer=layer, expert=expert)
                for layer in layers for expert in experts]

    def leaf_shape(self) -> tuple[int, ...]:
        """The jrl shape of one HF tensor's share (one layer, one expert)."""
        shape = list(self.hf_shape)
        if self.part is not None:
            shape[self.part_axis] //= self.part[1]
        if self.conv:
            return (shape[2], shape[0])
        if self.transpose:
            shape[-2:] = shape[-1:-3:-1]
        return tuple(shape)

    def param_shape(self) -> tuple[int, ...]:
        shape = self.leaf_shape()
        if self.experts:
            shape = (self.experts,) + shape
        return ((len(self.layers),) + shape) if self.per_layer else shape

    def to_jrl(self, array: np.ndarray) -> np.ndarray:
        """One HF tensor -> this param's share of it."""
        if self.part is not None:
            index, count = self.part
            size = array.shape[self.part_axis] // count
            array = np.take(array, np.arange(index * size, (index + 1) * size), self.part_axis)
        if self.conv:
            return array[:, 0, :].T
        return np.swapaxes(array, -1, -2) if self.transpose else array

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        """This param's share -> its part of the HF tensor (the inverse of to_jrl)."""
        if self.conv:
            return array.T[:, None, :]
        return np.swapaxes(array, -1, -2) if self.transpose else array


def _linear(path, name, out_dim, in_dim, layers):
    return TensorSpec(path, name, (out_dim, in_dim), True, layers)


def _mixer_specs(config: ModelConfig, kind: tuple[str, str], key: str, layer: str,
                 layers: tuple[int, ...]) -> list[TensorSpec]:
    d, hd = config.hidden_size, config.head_dim
    specs = [TensorSpec((key, "attn_norm"), layer + "input_layernorm.weight", (d,),
                        layers=layers)]
    if kind[0] == "attention":
        q, kv = config.q_size, config.kv_size
        attn = layer + "self_attn."
        # Qwen3.5: q_proj holds q and the output gate interleaved per head; jrl keeps it whole.
        q_out = 2 * q if config.attn_output_gate else q
        specs += [_linear((key, "wq"), attn + "q_proj.weight", q_out, d, layers),
                  _linear((key, "wk"), attn + "k_proj.weight", kv, d, layers),
                  _linear((key, "wv"), attn + "v_proj.weight", kv, d, layers)]
        if config.attention_bias:
            specs += [TensorSpec((key, "bq"), attn + "q_proj.bias", (q,), layers=layers),
                      TensorSpec((key, "bk"), attn + "k_proj.bias", (kv,), layers=layers),
                      TensorSpec((key, "bv"), attn + "v_proj.bias", (kv,), layers=layers)]
        if config.qk_norm:
            specs += [TensorSpec((key, "q_norm"), attn + "q_norm.weight", (hd,), layers=layers),
                      TensorSpec((key, "k_norm"), attn + "k_norm.weight", (hd,), layers=layers)]
        specs.append(_linear((key, "wo"), attn + "o_proj.weight", d, q, layers))
    else:
        lin = layer + "linear_attn."
        hv, vs = config.linear_num_value_heads, config.linear_value_size
        specs += [
            _linear((key, "w_qkv"), lin + "in_proj_qkv.weight", config.conv_size, d, layers),
            TensorSpec((key, "conv"), lin + "conv1d.weight",
                       (config.conv_size, 1, config.linear_conv_kernel_dim), layers=layers,
                       conv=True),
            _linear((key, "w_z"), lin + "in_proj_z.weight", vs, d, layers),
            _linear((key, "w_b"), lin + "in_proj_b.weight", hv, d, layers),
            _linear((key, "w_a"), lin + "in_proj_a.weight", hv, d, layers),
            TensorSpec((key, "dt_bias"), lin + "dt_bias", (hv,), layers=layers),
            TensorSpec((key, "A_log"), lin + "A_log", (hv,), layers=layers),
            TensorSpec((key, "delta_norm"), lin + "norm.weight",
                       (config.linear_value_head_dim,), layers=layers),
            _linear((key, "w_out"), lin + "out_proj.weight", d, vs, layers)]
    return specs


def _mlp_specs(config: ModelConfig, kind: tuple[str, str], key: str, layer: str,
               layers: tuple[int, ...], fused_experts: bool) -> list[TensorSpec]:
    d = config.hidden_size
    specs = [TensorSpec((key, "mlp_norm"), layer + "post_attention_layernorm.weight", (d,),
                        layers=layers)]
    mlp = layer + "mlp."
    if kind[1] == "dense":
        f = config.intermediate_size
        return specs + [_linear((key, "w_gate"), mlp + "gate_proj.weight", f, d, layers),
                        _linear((key, "w_up"), mlp + "up_proj.weight", f, d, layers),
                        _linear((key, "w_down"), mlp + "down_proj.weight", d, f, layers)]
    e, f = config.num_experts, config.moe_intermediate_size
    specs.append(_linear((key, "router"), mlp + "gate.weight", e, d, layers))
    if fused_experts:   # transformers >= 5: experts stacked in 3-D tensors
        gate_up = mlp + "experts.gate_up_proj"
        specs += [TensorSpec((key, "experts_gate"), gate_up, (e, 2 * f, d), True, layers,
                             part=(0, 2), part_axis=1),
                  TensorSpec((key, "experts_up"), gate_up, (e, 2 * f, d), True, layers,
                             part=(1, 2), part_axis=1),
                  TensorSpec((key, "experts_down"), mlp + "experts.down_proj", (e, d, f), True,
                             layers)]
    else:               # older checkpoints: one Linear per expert
        expert = mlp + "experts.{expert}."
        specs += [TensorSpec((key, "experts_gate"), expert + "gate_proj.weight", (f, d), True,
                             layers, experts=e),
                  TensorSpec((key, "experts_up"), expert + "up_proj.weight", (f, d), True,
                             layers, experts=e),
                  TensorSpec((key, "experts_down"), expert + "down_proj.weight", (d, f), True,
                             layers, experts=e)]
    if config.shared_expert_intermediate_size:
        fs = config.shared_expert_intermediate_size
        shared = mlp + "shared_expert."
        specs += [_linear((key, "shared_gate"), shared + "gate_proj.weight", fs, d, layers),
                  _linear((key, "shared_up"), shared + "up_proj.weight", fs, d, layers),
                  _linear((key, "shared_down"), shared + "down_proj.weight", d, fs, layers),
                  _linear((key, "shared_expert_gate"), mlp + "shared_expert_gate.weight", 1, d,
                          layers)]
    return specs


def tensor_specs(config: ModelConfig, *, prefix: str = "model.",
                 fused_experts: bool = True) -> list[TensorSpec]:
    """Every param of `config` with its HF name(s) and shape, in HF checkpoint order.

    prefix: where the text model's tensors live ("model." for a ForCausalLM checkpoint,
    "model.language_model." for Qwen3.5's conditional-generation one). fused_experts: MoE
    experts as transformers 5's stacked 3-D tensors (True) or one Linear per expert.
    """
    d, v = config.hidden_size, config.vocab_size
    layer = prefix + "layers.{layer}."
    specs = [TensorSpec(("embed",), prefix + "embed_tokens.weight", (v, d))]
    for kind in config.kinds:
        key = KIND_PARAM_KEYS[kind]
        layers = tuple(i for i, k in enumerate(config.layer_kinds) if k == kind)
        specs += _mixer_specs(config, kind, key, layer, layers)
        specs += _mlp_specs(config, kind, key, layer, layers, fused_experts)
    specs.append(TensorSpec(("final_norm",), prefix + "norm.weight", (d,)))
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
    try:
        with open(config_path) as handle:
            config = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    return config


def _shown(names: list[str], limit: int = 8) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def validate_and_convert(source, config: ModelConfig, specs: list[TensorSpec], where: str, *,
                         dtype: Any = None, ignored_prefixes: tuple[str, ...] = (),
                         lm_head_name: str = "lm_head.weight",
                         embed_name: str = "model.embed_tokens.weight") -> dict:
    """Checks that `source` holds exactly the tensors of `config` and converts them to params.

    source: names() -> set of HF tensor names, shape(name), read(name) -> numpy array [out, in],
      describe(name) -> the name to print in errors. ignored_prefixes: tensors outside the
      text model that are skipped (Qwen3.5's vision tower, its multi-token-prediction head).
    Raises ValueError naming a missing tensor, a wrong shape (expected and found) or tensors the
    layout has no place for. Returns the params pytree (jnp arrays in `dtype`, or the stored
    dtype when dtype is None).
    """
    expected: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        for name in spec.hf_names():
            expected[name] = spec.hf_shape
    present = {name for name in source.names() if not name.startswith(ignored_prefixes)}
    missing = [source.describe(name) for name in expected if name not in present]
    if missing:
        raise ValueError(f"{where}: missing tensor(s) {_shown(missing)} required by the "
                         f"{config.model_type} config")
    for name, shape in expected.items():
        found = source.shape(name)
        if found != shape:
            raise ValueError(f"{where}: tensor {source.describe(name)} has shape {list(found)}, "
                             f"expected {list(shape)} from the config")
    allowed_extra = {lm_head_name} if config.tie_word_embeddings else set()
    unexpected = sorted(source.describe(name) for name in present - set(expected) - allowed_extra
                        if not name.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor(s) {_shown(unexpected)}: jrl's "
                         f"{config.model_type} layout has no place for them (refusing to drop "
                         "weights silently)")
    if config.tie_word_embeddings and lm_head_name in present:
        lm_head = source.read(lm_head_name)
        embed = source.read(embed_name)
        if lm_head.shape != embed.shape or not np.array_equal(lm_head, embed):
            raise ValueError(f"{where}: tie_word_embeddings=true but {lm_head_name} differs from "
                             f"{embed_name}; set tie_word_embeddings=false to load them "
                             "separately")

    target = None if dtype is None else jnp.dtype(dtype)
    last: dict[str, np.ndarray] = {}     # a fused tensor is read once for its parts

    def read(name: str) -> np.ndarray:
        if name not in last:
            last.clear()
            last[name] = _checked_weights(source.read(name), source.describe(name), where)
        return last[name]

    params: dict = {}
    for spec in specs:
        pieces = [spec.to_jrl(read(name)) for name in spec.hf_names()]
        pieces = [p.astype(target) if target is not None else p for p in pieces]
        if spec.experts:
            pieces = [np.stack(pieces[i:i + spec.experts])
                      for i in range(0, len(pieces), spec.experts)]
        stacked = np.stack(pieces) if spec.per_layer else np.array(pieces[0], order="C")
        _set_path(params, spec.param_path, jnp.asarray(stacked))
    return params


def _checked_weights(array: np.ndarray, name: str, where: str) -> np.ndarray:
    """The tensor as read, after refusing what no weight can be: integer or boolean values (a
    cast would train on them silently) and NaN or infinity (every loss would be NaN, and the
    run's stop message would blame the learning rate)."""
    if array.dtype.kind in "iub":
        raise ValueError(f"{where}: tensor {name} holds {array.dtype} values; a model's weights "
                         "are floating point (float32, bfloat16, float16): refusing to cast it")
    finite = np.isfinite(np.asarray(array, np.float32))
    if not finite.all():
        bad = int(finite.size - finite.sum())
        raise ValueError(f"{where}: tensor {name} holds {bad} NaN or infinite value(s) of "
                         f"{finite.size}; the checkpoint is corrupt")
    return array


def _layout(directory: str, config_json: Mapping, config: ModelConfig, source) -> tuple:
    """(specs, ignored prefixes, lm_head name, embed name, note) for the checkpoint's layout:
    ForCausalLM ("model.*") or Qwen3.5's conditional generation ("model.language_model.*",
    with the vision tower and the MTP head skipped), fused or per-expert MoE weights."""
    _, multimodal = text_config(config_json)
    prefix = "model.language_model." if multimodal else "model."
    ignored: tuple[str, ...] = ("model.visual.", "mtp.") if multimodal else ("mtp.",)
    fused = True
    if config.has_moe:
        first = next(i for i, k in enumerate(config.layer_kinds) if k[1] == "moe")
        fused = f"{prefix}layers.{first}.mlp.experts.gate_up_proj" in source.names()
    names = source.names()
    skipped = [p for p in ignored if any(name.startswith(p) for name in names)]
    note = (f"{directory}: loaded the text model; skipped {', '.join(p + '*' for p in skipped)} "
            "(the vision tower / multi-token-prediction head are not part of jrl's layout)"
            if skipped else None)
    specs = tensor_specs(config, prefix=prefix, fused_experts=fused)
    return specs, ignored, "lm_head.weight", prefix + "embed_tokens.weight", note


def _print_note(message: str) -> None:
    print(message, file=sys.stderr)


def load_hf(path: str | os.PathLike, *, dtype: Any = None,
            log: Callable[[str], None] | None = _print_note) -> tuple[ModelConfig, dict]:
    """Loads an HF directory (config.json + model.safetensors or a sharded index).

    Args:
      path: the checkpoint directory: a ForCausalLM checkpoint of any family in
        jrl.models.hf_config.FAMILIES, or Qwen3.5's conditional-generation one (its text model;
        the vision tower and the MTP head are skipped with a one-line note).
      dtype: dtype of the returned params; None keeps each tensor's stored dtype (so a bfloat16
        checkpoint loads as bfloat16, bit for bit).
      log: where the skipped-tensors note goes (None: nowhere).
    Returns:
      (config, params): params in the jrl layout (see jrl.models.transformer), jnp arrays.
    """
    directory = os.fspath(path)
    config_json = read_hf_config(directory)
    config = config_from_hf(config_json)
    source = _TensorSource(directory)
    specs, ignored, lm_head, embed, note = _layout(directory, config_json, config, source)
    params = validate_and_convert(source, config, specs, directory, dtype=dtype,
                                  ignored_prefixes=ignored, lm_head_name=lm_head,
                                  embed_name=embed)
    if note and log is not None:
        log(note)
    return config, params


class _Prefixed:
    """The tensors of a source whose names start with `prefix` (the others are not seen)."""

    def __init__(self, source, prefix: str):
        self.source, self.prefix = source, prefix

    def names(self) -> set[str]:
        return {name for name in self.source.names() if name.startswith(self.prefix)}

    def __getattr__(self, name):
        return getattr(self.source, name)


def load_hf_mtp(path: str | os.PathLike, *, dtype: Any = None) -> tuple[ModelConfig, dict]:
    """The multi-token-prediction head of a Qwen3.5 checkpoint (its mtp.* tensors, which
    load_hf skips) as jrl.models.mtp params.

    HF names: mtp.pre_fc_norm_embedding / pre_fc_norm_hidden / norm .weight [D], mtp.fc.weight
    [D, 2D] (stored [2D, D]), and one decoder block mtp.layers.0.* in the layout of the text
    model's full-attention layers (dense or MoE MLP, fused or per-expert experts).
    Returns (the target's config, head params). Raises ValueError naming the directory when it
    has no mtp.* tensors, when config.json asks for more than one MTP layer (jrl runs one, as
    Qwen3.5 ships), or for a missing, misshapen or unexpected tensor."""
    directory = os.fspath(path)
    config_json = read_hf_config(directory)
    config = config_from_hf(config_json)
    text, _ = text_config(config_json)
    source = _Prefixed(_TensorSource(directory), "mtp.")
    if not source.names():
        raise ValueError(f"{directory}: no multi-token-prediction head (no mtp.* tensors); "
                         "draft with the n-gram source or a draft model instead")
    layers = text.get("mtp_num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{directory}/config.json: mtp_num_hidden_layers={layers!r}; jrl runs an "
                         "MTP head of exactly 1 layer (Qwen3.5's)")
    block = mtp.block_config(config)
    fused = (not block.has_moe) or "mtp.layers.0.mlp.experts.gate_up_proj" in source.names()
    head = validate_and_convert(source, block.replace(tie_word_embeddings=True),
                                mtp_tensor_specs(config, fused_experts=fused),
                                f"{directory} (MTP head)", dtype=dtype)
    return config, head


def has_mtp_head(path: str | os.PathLike) -> bool:
    """Whether the HF directory at path holds an MTP head (mtp.* tensors)."""
    return bool(_Prefixed(_TensorSource(os.fspath(path)), "mtp.").names())


def mtp_tensor_specs(config: ModelConfig, *, fused_experts: bool = True) -> list[TensorSpec]:
    """The MTP head's params (jrl.models.mtp) with their HF names: its block as the text
    model's layer 0 under "mtp.", its final norm mtp.norm, the pre-fc norms and fc."""
    d = config.hidden_size
    specs = [spec for spec in tensor_specs(mtp.block_config(config), prefix="mtp.",
                                           fused_experts=fused_experts)
             if spec.param_path[0] not in ("embed", "lm_head")]
    return specs + [TensorSpec(("embed_norm",), "mtp.pre_fc_norm_embedding.weight", (d,)),
                    TensorSpec(("hidden_norm",), "mtp.pre_fc_norm_hidden.weight", (d,)),
                    _linear(("fc",), "mtp.fc.weight", d, 2 * d, ())]


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
        expected = spec.param_shape()
        if tuple(value.shape) != expected:
            raise ValueError(f"params/{'/'.join(spec.param_path)} has shape {list(value.shape)}, "
                             f"expected {list(expected)}")


def _hf_tensors(config: ModelConfig, params: Mapping, specs: list[TensorSpec],
                dtype: np.dtype) -> Iterator[tuple[str, Callable[[], np.ndarray], int]]:
    """(hf name, thunk producing the HF tensor, its size in bytes), in checkpoint order:
    the embedding, then layer by layer, then the final norm and lm_head. Parts of one fused HF
    tensor (gate_up_proj) are joined along their axis."""
    host: dict[tuple[str, ...], np.ndarray] = {}

    def host_array(path):
        if path not in host:
            host[path] = np.asarray(_get_path(params, path))
        return host[path]

    by_name: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        by_name.setdefault(spec.hf_name, []).append(spec)

    def make(group: list[TensorSpec], layer: int | None, expert: int | None):
        def thunk():
            parts = []
            for spec in sorted(group, key=lambda sp: sp.part[0] if sp.part else 0):
                array = host_array(spec.param_path)
                if layer is not None:
                    array = array[spec.layers.index(layer)]
                if expert is not None:
                    array = array[expert]
                parts.append(spec.to_hf(array))
            axis = group[0].part_axis
            joined = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
            return np.ascontiguousarray(joined.astype(dtype))
        return thunk

    nbytes = lambda spec: int(np.prod(spec.hf_shape)) * dtype.itemsize

    def emit(name_template: str, layer: int | None):
        # The specs filling this HF tensor: one, or the parts of a fused one (of this layer:
        # layers of different kinds share name templates).
        group = [sp for sp in by_name[name_template] if layer is None or layer in sp.layers]
        spec = group[0]
        for expert in (range(spec.experts) if spec.experts else (None,)):
            name = name_template.format(layer=layer, expert=expert)
            yield name, make(group, layer, expert), nbytes(spec)

    done: set[str] = set()
    for spec in specs:
        if spec.param_path == ("embed",):
            yield from emit(spec.hf_name, None)
            done.add(spec.hf_name)
    for layer in range(config.num_layers):
        seen: set[str] = set()
        for spec in specs:
            if spec.per_layer and layer in spec.layers and spec.hf_name not in seen:
                seen.add(spec.hf_name)
                yield from emit(spec.hf_name, layer)
    for spec in specs:
        if not spec.per_layer and spec.hf_name not in done:
            done.add(spec.hf_name)
            yield from emit(spec.hf_name, None)


def _check_file_name(name: str) -> None:
    if not name or os.path.basename(name) != name or name in (".", ".."):
        raise ValueError(f"extra_files: {name!r} must be a plain file name (no directories)")


def save_hf(path: str | os.PathLike, config: ModelConfig, params: Mapping, *, dtype: Any,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
            extra_files: Mapping[str, str | bytes] | None = None,
            mtp_head: Mapping | None = None) -> None:
    """Writes an HF directory: config.json + model.safetensors (or shards + index).

    Args:
      path: the directory to create. It must not exist (or be empty) unless overwrite=True.
      config, params: the model, params in the jrl layout.
      dtype: dtype of the stored tensors ("float32", "bfloat16" or "float16").
      max_shard_bytes: above this total size the tensors are split into
        model-0000i-of-0000n.safetensors files with a model.safetensors.index.json.
      overwrite: replace an existing checkpoint at `path`.
      extra_files: file name -> contents (e.g. tokenizer.json), written in the same atomic step.
      mtp_head: an MTP head's params (jrl.models.mtp, e.g. load_hf_mtp's), written as the
        checkpoint's mtp.* tensors (with mtp_num_hidden_layers = 1 in config.json), so that a
        trained Qwen3.5 policy keeps the head its serving engine drafts with.
    Everything is written to a temporary sibling directory, fsynced and renamed into place, so
    `path` holds either the old checkpoint or the complete new one, never a partial one. A URL
    (gs://, s3://, az://; jrl.paths) is written to a local temporary directory, then uploaded
    file by file; a failed upload removes what it wrote (an object store has no rename).
    """
    target = paths.resolve(path)
    dtype_name = normalize_dtype_name(dtype)
    np_dtype = np.dtype(jnp.dtype(dtype_name))
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be positive")
    for name in extra_files or {}:
        _check_file_name(name)

    def occupied() -> bool:
        return paths.exists(target) and (not paths.isdir(target) or paths.listdir(target))

    if occupied() and not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; pass overwrite=True to "
                              "replace it")
    specs = tensor_specs(config)
    hf_config = config_to_hf(config, dtype_name)
    _validate_params(config, params, specs)
    if mtp_head is not None:
        mtp.check_params(mtp_head, config)
        hf_config["mtp_num_hidden_layers"] = 1

    staging = _staging_directory(target)
    try:
        os.chmod(staging, 0o777 & ~_current_umask())  # mkdtemp makes it private (0700)
        tensors = list(_hf_tensors(config, params, specs, np_dtype))
        if mtp_head is not None:
            tensors += list(_hf_tensors(mtp.block_config(config), mtp_head,
                                        mtp_tensor_specs(config), np_dtype))
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


def _staging_directory(target: str) -> str:
    """A new directory to write an export into before _publish: a hidden sibling of a local
    target (renamed into place), a local temporary directory for a URL (uploaded)."""
    if paths.is_url(target):
        return tempfile.mkdtemp(prefix="jrl-export-")
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)


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
    """Renames the finished staging directory to target (replacing an old one if allowed); a
    URL target: uploads its files there, then removes the staging directory."""
    if paths.is_url(target):
        if paths.listdir(target):
            if not overwrite:
                raise FileExistsError(f"{target} appeared while saving; pass overwrite=True")
            paths.rmtree(target)
        paths.upload_directory(staging, target)
        shutil.rmtree(staging, ignore_errors=True)
        return
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
