"""The decoder as a Flax NNX module: jrl's one model face.

    model = Decoder(config, rngs=nnx.Rngs(0))       # any family; Qwen3(...), Qwen35(...) pin one
    model = Decoder.from_pretrained("path/to/hf_dir_or.gguf")   # weights + tokenizer
    logits = model(tokens, mask=mask)               # [B, T] -> [B, T, V] float32
    params = params_of(model)                       # the plain params pytree (no copy)
    graphdef, state = nnx.split(model)              # state["params"] is that same pytree

The module's weights are an nnx.Param per leaf of the params pytree (jrl.models.transformer.
param_shapes), each carrying its logical sharding axes as metadata (`logical_axes`, from
jrl.models.sharding), and its forward IS the functional core applied to them
(transformer.forward_logits(params_of(self), ...)): no parallel copy of the layers exists, so the
module and the core give the same bits by construction, for every family (Llama, Qwen2, Qwen3,
Qwen3-MoE, Qwen3.5, Qwen3.5-MoE). jrl's sampler and train step run on the pytree: pass
`params_of(model)` (or the module itself where a part accepts one: jrl.models.as_params).

As in Tunix, a module becomes an actor and a reference by splitting its state: the actor's
params train, and a frozen copy of params_of(model) taken after the warm start is the
reference policy.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jrl.kernels.contract import NumericalContract
from jrl.kernels.quantized import QuantizedWeight
from jrl.models import transformer
from jrl.models.loading import load_pretrained
from jrl.models.lora import is_adapter
from jrl.models.config import ModelConfig
from jrl.models.sharding import param_logical_axes


def _value(variable: nnx.Variable):
    """The array a Variable holds (get_value() where flax has it; .value before)."""
    getter = getattr(variable, "get_value", None)
    return getter() if getter is not None else variable.value


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_weight(x) -> bool:
    """A leaf of the params pytree: an array, or a QuantizedWeight (QLoRA's base), kept whole."""
    return isinstance(x, QuantizedWeight)


class Decoder(nnx.Module):
    """A decoder of `config` (any model_type in jrl.models.config.MODEL_TYPES).

    rngs: nnx.Rngs whose `params` stream initialises the weights exactly as
    transformer.init_params(config, rngs.params()) does; or params: a params pytree of
    param_shapes(config) (used as is, no copy). dtype: the param dtype of a random init.
    contract: the numerical contract every call runs with (default NumericalContract()).
    tokenizer: kept for from_pretrained's callers (None for a random init).
    """

    model_type: str | None = None      # subclasses pin the family

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None,
                 params: dict | None = None, dtype=jnp.float32,
                 contract: NumericalContract | None = None, tokenizer=None):
        if self.model_type is not None and config.model_type != self.model_type:
            raise ValueError(f"{type(self).__name__}: config.model_type={config.model_type!r}; "
                             f"this class builds {self.model_type!r} models (or use Decoder)")
        if (rngs is None) == (params is None):
            raise ValueError(f"{type(self).__name__}: pass exactly one of rngs= (random init) "
                             "or params= (a params pytree)")
        if params is None:
            params = transformer.init_params(config, rngs.params(), dtype)
        _check_shapes(config, params)
        self.config = config
        self.contract = contract if contract is not None else NumericalContract()
        self.tokenizer = tokenizer
        axes = param_logical_axes(config)
        # LoRA adapters are nnx.LoRAParam (a Param subclass), so nnx.state(model,
        # nnx.LoRAParam) and nnx.DiffState filters select them the way the ecosystem does.
        self.weights = nnx.data(jax.tree_util.tree_map_with_path(
            lambda path, value, names: (nnx.LoRAParam if is_adapter(str(path[-1].key))
                                        else nnx.Param)(value, logical_axes=names),
            params, axes, is_leaf=_is_weight))

    @property
    def params(self) -> dict:
        """The params pytree (the Params' arrays, no copy)."""
        return params_of(self)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *,
                        contract: NumericalContract | None = None, dtype=None) -> "Decoder":
        """An HF directory (config.json + safetensors; tokenizer.json if present) or a .gguf
        file as a module; see jrl.models.load for the arguments."""
        config, params, tokenizer, contract = load_pretrained(path, contract=contract,
                                                              dtype=dtype)
        return cls(config, params=params, contract=contract, tokenizer=tokenizer)

    def hidden(self, tokens: jax.Array, *, mask: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
        """Final-norm hidden states [B, T, D] (compute dtype) of a right-padded batch."""
        hidden, _ = transformer.forward_hidden(params_of(self), self.config,
                                               jnp.asarray(tokens, jnp.int32),
                                               contract=self.contract, positions=positions,
                                               mask=mask)
        return hidden

    def __call__(self, tokens: jax.Array, *, mask: jax.Array | None = None,
                 positions: jax.Array | None = None, lengths=None) -> jax.Array:
        """Logits [B, T, V] float32 of a right-padded batch (mask [B, T] bool, or lengths [B])."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if mask is not None and lengths is not None:
            raise ValueError("Decoder(...): pass either mask or lengths, not both")
        if lengths is not None:
            mask = jnp.arange(tokens.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
        return _jitted_logits(params_of(self), tokens,
                              None if mask is None else jnp.asarray(mask, bool), positions,
                              config=self.config, contract=self.contract)


@functools.partial(jax.jit, static_argnames=("config", "contract"))
def _jitted_logits(params, tokens, mask, positions, *, config, contract):
    return transformer.forward_logits(params, config, tokens, contract=contract, mask=mask,
                                      positions=positions)


class Llama(Decoder):
    model_type = "llama"


class Qwen2(Decoder):
    model_type = "qwen2"


class Qwen3(Decoder):
    model_type = "qwen3"


class Qwen3Moe(Decoder):
    model_type = "qwen3_moe"


class Qwen35(Decoder):
    model_type = "qwen3_5_text"


class Qwen35Moe(Decoder):
    model_type = "qwen3_5_moe_text"


def load(path: str | os.PathLike, *, contract: NumericalContract | None = None,
         dtype=None) -> Decoder:
    """Loads pretrained weights as a Decoder (an NNX module; jrl.models.nnx_model).

    path: an HF directory (config.json + safetensors; tokenizer.json if present) or a .gguf
      file (tokenizer from its metadata).
    contract: the numerical contract the model runs with (default NumericalContract()); params
      are cast to contract.param_dtype. dtype: shorthand for a default contract with that
      param_dtype (an error if it disagrees with an explicit contract).
    The tokenizer (or None when an HF directory has no tokenizer.json) is `model.tokenizer`;
    the config's eos ids are added to its stop tokens. `model.params` is the params pytree.
    """
    return Decoder.from_pretrained(path, contract=contract, dtype=dtype)


def _check_shapes(config: ModelConfig, params: dict) -> None:
    expected = transformer.param_shapes(config)
    got = jax.tree.map(lambda x: tuple(x.shape), params, is_leaf=_is_weight)
    if got != expected:
        raise ValueError(f"the params do not match config {config.model_type!r}: expected "
                         f"shapes {expected}, got {got}")


def params_of(model: Decoder) -> dict:
    """The module's weights as the plain params pytree of transformer.param_shapes (the same
    arrays, no copy)."""
    return jax.tree.map(_value, model.weights, is_leaf=_is_variable)


def logical_axes_of(model: Decoder) -> dict:
    """The logical sharding axes the module's Params carry (jrl.models.sharding)."""
    return jax.tree.map(lambda v: v.get_metadata()["logical_axes"], model.weights,
                        is_leaf=_is_variable)


def from_params(config: ModelConfig, params: dict, *,
                contract: NumericalContract | None = None) -> Decoder:
    """A Decoder holding `params` (a pytree of transformer.param_shapes(config))."""
    return Decoder(config, params=params, contract=contract)


def as_params(model_or_params):
    """The params pytree of a Decoder, or the pytree itself: what the sampler and train step
    take."""
    return params_of(model_or_params) if isinstance(model_or_params, Decoder) else \
        model_or_params
