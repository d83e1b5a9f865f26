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
import tempfile
import uuid
from typing import Any, Callable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from jrl.models.config import ModelConfig
from jrl.models.hf_config import config_from_hf, config_to_hf, normalize_dtype_name
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
    dtype_name = normalize_dtype_name(dtype)
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
