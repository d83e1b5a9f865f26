"""LoRA and QLoRA on jrl's one numerical path: adapters in the params pytree, a frozen base.

    config, params = attach(config, params, LoraConfig(rank=16, alpha=32))   # B = 0: the base
    y = project(x, layer, "wq", config=config, contract=contract)           # every block
    adapters, base = split(params);  params = merge(adapters, base)
    trainable, frozen = split_trainable(params)      # what the optimizer sees / what it never
    merged = merged_params(config, params)           # W + scale A B: the HF export

Where the adapters live: inside the layer dicts, next to the weight they adapt, stacked per
layer kind like it: `layers["wq_lora_a"]` [L, K, r] and `layers["wq_lora_b"]` [L, r, N] for
`layers["wq"]` [L, K, N]. Why there and not in a separate subtree: the layer scan, the per-slot
sampler programs, sharding annotations and every block already walk the layer dicts, so an
adapter reaches exactly the code that uses its weight with no new plumbing, and the sampler
and the train forward run it through the same `project` call. The adapters are told apart by
name (ADAPTER_SUFFIXES), the filter `split` uses; in the NNX Decoder they are nnx.LoRAParam
(nnx.state(model, nnx.LoRAParam) is the same set).

The frozen base: a model with adapters trains its adapters only (`split_trainable`): the train
step differentiates them alone, the optimizer state covers them alone, checkpoints hold them
(and their optimizer state) alone, publishing copies them alone to the rollout devices, where
the base stays resident. QLoRA stores the base's projections quantised
(jrl.kernels.quantized: int8 per output channel or NF4 blocks), dequantised tile by tile in
the matmul kernel; the embedding, norms and the MoE router stay in the param dtype.

The forward (jrl.kernels.lora_matmul): y = round(x W + (alpha / rank) * round(x A) B), float32
combine rounded once in fixed row tiles: the same bits in sampler and trainer.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.kernels.quantized import NF4_BLOCK, QuantizedWeight, dequantize
from jrl.models.config import ALL_LINEAR, LORA_TARGETS, LoraConfig, ModelConfig

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")
# The projections QLoRA stores quantised (the router stays float: routing runs in float32).
QUANTIZED_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_qkv", "w_z", "w_a",
                     "w_b", "w_out", "shared_gate", "shared_up", "shared_down")


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_of(name: str) -> str:
    """"wq_lora_a" -> "wq"."""
    return name[:-len(ADAPTER_SUFFIXES[0])]


def adapted_weights(config: ModelConfig, shapes: dict) -> dict[str, tuple[str, ...]]:
    """{KIND_PARAM_KEYS[kind]: the weight names that carry adapters} for the layer kinds that
    have any (empty without LoRA), given `shapes`, the base model's param_shapes. Raises
    ValueError naming a target this architecture does not have."""
    if config.lora is None:
        return {}
    names_present = {name for value in shapes.values() if isinstance(value, dict)
                     for name in value}
    targets = config.lora.targets
    if ALL_LINEAR in targets:
        targets = tuple(t for t in LORA_TARGETS if names_present & set(LORA_TARGETS[t]))
    missing = [t for t in targets if not names_present & set(LORA_TARGETS[t])]
    if missing:
        have = [t for t in LORA_TARGETS if names_present & set(LORA_TARGETS[t])]
        raise ValueError(f"model.lora.targets: {missing} not present in this "
                         f"{config.model_type} model; it has {have} (or use '{ALL_LINEAR}')")
    wanted = {name for t in targets for name in LORA_TARGETS[t]}
    out = {}
    for key, value in shapes.items():
        if isinstance(value, dict):
            names = tuple(name for name in value if name in wanted)
            if names:
                out[key] = names
    return out


def with_adapter_shapes(config: ModelConfig, shapes: dict) -> dict:
    """`shapes` (transformer.param_shapes of the base) plus every adapter: name_lora_a
    [..., K, r] and name_lora_b [..., r, N] next to each targeted weight [..., K, N]."""
    if config.lora is None:
        return shapes
    rank = config.lora.rank
    out = dict(shapes)
    for key, names in adapted_weights(config, shapes).items():
        layer = dict(out[key])
        for name in names:
            *lead, k, n = layer[name]
            layer[name + "_lora_a"] = (*lead, k, rank)
            layer[name + "_lora_b"] = (*lead, rank, n)
        out[key] = layer
    return out


def init_adapter(name: str, shape: tuple, key: jax.Array, dtype) -> jax.Array:
    """A: uniform(-1/sqrt(K), 1/sqrt(K)) (PEFT's kaiming_uniform(a=sqrt(5)) on lora_A [r, K]);
    B: zeros, so that the adapted model starts exactly at the base model."""
    if name.endswith("_lora_b"):
        return jnp.zeros(shape, dtype)
    bound = 1.0 / np.sqrt(shape[-2])
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


# -------------------------------------------------------------------------------------------------
# The forward: every block's projections go through here.

def project(x: jax.Array, layer: Mapping, name: str, *, config: ModelConfig | None,
            contract: NumericalContract) -> jax.Array:
    """x [..., K] @ layer[name] [K, N] (+ the adapter's (alpha / rank) (x A) B when the layer
    has one) -> [..., N] in the compute dtype. layer[name] may be a QuantizedWeight."""
    a = layer.get(name + "_lora_a")
    if a is None:
        return kernels.matmul(x, layer[name], contract=contract)
    if config is None or config.lora is None:
        raise ValueError(f"project: layer has adapters for {name!r} but the model config has "
                         "no lora section (its alpha / rank scale)")
    return kernels.lora_matmul(x, layer[name], a, layer[name + "_lora_b"],
                               scale=config.lora.scale, contract=contract)


def project_rows(x: jax.Array, layer: Mapping, name: str, *, config: ModelConfig | None,
                 contract: NumericalContract, tensor_axis: str | None = None) -> jax.Array:
    """A row-parallel projection (attention output, MLP down, Gated DeltaNet output): `project`,
    or with contract.tensor_shards > 1 or a tensor_axis (inside shard_map: x and the weight hold
    this device's input rows) the shard-ordered reduction of kernels.row_parallel_matmul, whose
    bits do not depend on the tensor-parallel degree. x [..., K] -> [..., N]."""
    if contract.tensor_shards == 1 and tensor_axis is None:
        return project(x, layer, name, config=config, contract=contract)
    if layer.get(name + "_lora_a") is not None or isinstance(layer[name], QuantizedWeight):
        raise ValueError(f"NumericalContract.tensor_shards={contract.tensor_shards}: the "
                         f"row-parallel {name!r} runs on plain weights; LoRA adapters and "
                         "quantised bases are not supported there yet (tensor_shards=1)")
    return kernels.row_parallel_matmul(x, layer[name], contract=contract, axis=tensor_axis)


def project_all(x: jax.Array, layer: Mapping, names: tuple[str, ...], *,
                config: ModelConfig | None, contract: NumericalContract,
                norm: tuple[jax.Array, float] | None = None) -> tuple[jax.Array, ...]:
    """project(xn, layer, name) for each name, xn = x or, with norm = (scale, eps), x's RMSNorm.
    Plain weights (no adapter, not quantised) run as one kernel with the norm in its prologue
    (kernels.projections); otherwise the norm kernel, then one project per name. x [..., K]."""
    plain = all(layer.get(name + "_lora_a") is None
                and not isinstance(layer[name], QuantizedWeight) for name in names)
    if plain:
        return kernels.projections(x, [layer[name] for name in names], contract=contract,
                                   norm=norm)
    if norm is not None:
        x = kernels.rms_norm(x, norm[0], eps=norm[1], contract=contract)
    return tuple(project(x, layer, name, config=config, contract=contract) for name in names)


# -------------------------------------------------------------------------------------------------
# The split: adapters (trainable) vs the frozen base.

def _split(tree: Mapping, keep) -> tuple[dict, dict]:
    picked, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            a, b = _split(value, keep)
            if a:
                picked[key] = a
            if b:
                rest[key] = b
        elif keep(key):
            picked[key] = value
        else:
            rest[key] = value
    return picked, rest


def split(params: Mapping) -> tuple[dict, dict]:
    """(adapters, base): the same nested dicts, each holding only its own leaves."""
    return _split(params, is_adapter)


def merge(first: Mapping, second: Mapping) -> dict:
    """The union of two disjoint nested dicts (split's inverse)."""
    out = dict(second)
    for key, value in first.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(value, out[key])
        else:
            out[key] = value
    return out


def has_adapters(params: Any) -> bool:
    if not isinstance(params, Mapping):
        return False
    for key, value in params.items():
        if has_adapters(value) if isinstance(value, Mapping) else is_adapter(str(key)):
            return True
    return False


def split_trainable(params: Any) -> tuple[Any, dict]:
    """(trainable, frozen): with adapters, the adapters and the base; without, every param and
    {}. merge(trainable, frozen) gives the params back. The train step, optimizer state,
    checkpoints and weight publishing all cut the params here."""
    if has_adapters(params):
        return split(params)
    return params, {}


def merge_trainable(trainable: Any, frozen: Mapping) -> Any:
    """split_trainable's inverse."""
    return merge(trainable, frozen) if frozen else trainable


# -------------------------------------------------------------------------------------------------
# Building an adapted model from a base one.

def quantize_base(config: ModelConfig, params: Mapping, fmt: str) -> dict:
    """params with every projection in QUANTIZED_WEIGHTS stored as a QuantizedWeight of `fmt`
    (the base must have no adapters yet)."""
    out = {}
    for key, value in params.items():
        if not isinstance(value, Mapping):
            out[key] = value
            continue
        layer = {}
        for name, w in value.items():
            if name in QUANTIZED_WEIGHTS and not isinstance(w, QuantizedWeight):
                k = w.shape[-2]
                if fmt == "nf4" and k % NF4_BLOCK:
                    raise ValueError(f"model.lora.quantize='nf4': params/{key}/{name} has input "
                                     f"dim {k}, not a multiple of NF4's block of {NF4_BLOCK}; "
                                     "use quantize='int8'")
                w = kernels.quantize(w, fmt)
            layer[name] = w
        out[key] = layer
    return out


def _check_rank(config: ModelConfig, shapes: dict) -> None:
    """Refuses a rank above min(K, N) of an adapted weight [..., K, N]: A B then has rank at
    most min(K, N), so a larger r adds parameters and nothing else (the probe: rank 4096 on a
    384-wide model, 50x its parameters)."""
    rank = config.lora.rank
    for key, names in adapted_weights(config, shapes).items():
        for name in names:
            *_, k, n = shapes[key][name]
            if rank > min(k, n):
                raise ValueError(f"model.lora.rank={rank}: above min(in, out) = {min(k, n)} of "
                                 f"the adapted weight {key}.{name} [{k}, {n}], where a rank-r "
                                 "update has rank at most min(in, out); use a rank of at most "
                                 f"{min(k, n)}")


def attach(config: ModelConfig, params: Mapping, lora: LoraConfig, *, dtype=None
           ) -> tuple[ModelConfig, dict]:
    """(config with `lora`, params with fresh adapters: A random from lora.seed (0 when None),
    B = 0), the base quantised when lora.quantize says so. dtype: the adapters' dtype (default:
    that of the embedding). rank 0 returns the inputs unchanged."""
    if not lora.enabled:
        return config, dict(params)
    if config.lora is not None:
        raise ValueError("attach: the model already has adapters")
    adapted = config.replace(lora=lora)
    # The base's shapes are read off its params (transformer.param_shapes' layout), so the
    # targets are validated against the model actually given.
    base_shapes = jax.tree.map(lambda x: tuple(jnp.shape(x)), params)
    _check_rank(adapted, base_shapes)
    shapes = with_adapter_shapes(adapted, base_shapes)
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.asarray(params["embed"]).dtype
    base = dict(params)
    if lora.quantize != "none":
        base = quantize_base(config, base, lora.quantize)
    names = [(key, name) for key, value in shapes.items() if isinstance(value, dict)
             for name in value if is_adapter(name)]
    seed = 0 if lora.seed is None else lora.seed
    keys = jax.random.split(jax.random.key(seed), len(names))
    adapters: dict = {}
    for rng, (key, name) in zip(keys, names):
        adapters.setdefault(key, {})[name] = init_adapter(name, shapes[key][name], rng, dtype)
    return adapted, merge(adapters, base)


def base_config(config: ModelConfig) -> ModelConfig:
    return config.replace(lora=None)


def merged_params(config: ModelConfig, params: Mapping) -> dict:
    """The plain params of base_config(config) (host numpy, float32): every adapted weight
    replaced by W + (alpha / rank) A B and every quantised one dequantised. What --export-hf
    writes: a dense model that transformers runs without peft (equal to the adapted model up to
    one float32 rounding per weight)."""
    scale = config.lora.scale if config.lora is not None else 1.0
    out = {}
    for key, value in params.items():
        if not isinstance(value, Mapping):
            out[key] = np.asarray(jax.device_get(value), np.float32)
            continue
        layer = {}
        for name, w in value.items():
            if is_adapter(name):
                continue
            w = dequantize(w) if isinstance(w, QuantizedWeight) else w
            w = np.asarray(jax.device_get(w), np.float32)
            if name + "_lora_a" in value:
                a = np.asarray(jax.device_get(value[name + "_lora_a"]), np.float32)
                b = np.asarray(jax.device_get(value[name + "_lora_b"]), np.float32)
                w = (w.astype(np.float64) + scale * np.matmul(a.astype(np.float64),
                                                              b.astype(np.float64)))
                w = w.astype(np.float32)
            layer[name] = w
        out[key] = layer
    return out


def dequantized_base(params: Mapping) -> dict:
    """The base (adapters dropped) with quantised weights dequantised to float32: the dense
    model an exported PEFT adapter applies to."""
    _, base = split(params)
    return jax.tree.map(lambda w: dequantize(w) if isinstance(w, QuantizedWeight) else w, base,
                        is_leaf=lambda x: isinstance(x, QuantizedWeight))


def param_bytes(params: Any) -> int:
    """Bytes of a params pytree as stored (QuantizedWeight: codes + scales)."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                   for x in jax.tree.leaves(params)))
