"""The Llama / Qwen2 / Qwen3 decoder as Flax NNX modules over jrl's functional core.

    model = Qwen3(config, rngs=nnx.Rngs(0))          # or Llama(...), Qwen2(...), Decoder(...)
    logits = model(tokens, mask=mask)                # [B, T] -> [B, T, V] float32
    params = params_of(model)                        # the plain params pytree jrl jits and trains
    model = from_params(config, params)              # and back (e.g. after training or loading)

Each module holds its weights as nnx.Param under the names of the params pytree
(jrl.models.transformer.param_shapes) and calls jrl.kernels through the same functions as the
functional core (transformer._layer, rms_norm, logits_from_hidden), so a module and the pure
forward on params_of(module) give the same bits: the sampler, the train step and Orbax checkpoints
keep working on `params_of(model)`, and `nnx.split(model)` gives the same arrays as an nnx.State.
The decoder layers are stacked on a leading axis and run under one lax.scan, as in the core.

Bringing your own NNX model: jrl's sampler and train step run the functional core (prefill and
decode with a KV cache, batch-invariant kernels), so a model enters jrl as a config of this family
and a params pytree: build `Decoder(config, ...)` (any ModelConfig: sizes, GQA, qk_norm,
attention bias, tied embeddings, RoPE theta) and load your weights with `from_params`, or convert
your module's state into the pytree layout of `param_shapes`. An architecture outside this family
needs its own forward with a KV cache; jrl does not trace arbitrary modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig

def _value(variable: nnx.Variable):
    """The array a Variable holds (get_value() where flax has it; .value before)."""
    getter = getattr(variable, "get_value", None)
    return getter() if getter is not None else variable.value


class Embed(nnx.Module):
    """Token embedding [V, D]: tokens [B, T] -> [B, T, D] in the compute dtype."""

    def __init__(self, embedding: jax.Array):
        self.embedding = nnx.Param(embedding)

    def __call__(self, tokens: jax.Array, contract: NumericalContract) -> jax.Array:
        return _value(self.embedding)[tokens].astype(contract.compute)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight through kernels.rms_norm."""

    def __init__(self, weight: jax.Array, eps: float):
        self.weight = nnx.Param(weight)
        self.eps = eps

    def __call__(self, x: jax.Array, contract: NumericalContract) -> jax.Array:
        return kernels.rms_norm(x, _value(self.weight), eps=self.eps, contract=contract)


class DecoderLayers(nnx.Module):
    """All decoder blocks, weights stacked [L, ...] (param_shapes()["layers"]), run under one
    lax.scan of transformer._layer: attention (kernels.attention, RoPE, optional qk-norm and
    bias) and SwiGLU MLP, each with its pre-norm and residual."""

    def __init__(self, config: ModelConfig, layers: dict):
        self.config = config
        # The config decides which weights exist (biases, qk-norm): param_shapes is the one list.
        self.names = tuple(transformer.param_shapes(config)["layers"])
        for name in self.names:
            setattr(self, name, nnx.Param(layers[name]))

    def weights(self) -> dict:
        return {name: _value(getattr(self, name)) for name in self.names}

    def __call__(self, h: jax.Array, contract: NumericalContract, positions: jax.Array,
                 mask: jax.Array) -> jax.Array:
        def body(h, layer):
            h, _, _ = transformer._layer(h, layer, None, None, kind=("attention", "dense"),
                                         config=self.config, contract=contract,
                                         positions=positions, mask=mask, lengths=None)
            return h, None
        h, _ = jax.lax.scan(body, h, self.weights())
        return h


class Decoder(nnx.Module):
    """A decoder-only transformer of `config` (llama, qwen2 or qwen3 model_type).

    rngs: nnx.Rngs whose `params` stream initialises the weights exactly as
    transformer.init_params(config, rngs.params()) does. dtype: the param dtype. contract: the
    numerical contract every call runs with (default NumericalContract()).
    """

    model_type: str | None = None      # subclasses pin the family

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None,
                 params: dict | None = None, dtype=jnp.float32,
                 contract: NumericalContract | None = None):
        if self.model_type is not None and config.model_type != self.model_type:
            raise ValueError(f"{type(self).__name__}: config.model_type={config.model_type!r}; "
                             f"this class builds {self.model_type!r} models (or use Decoder)")
        if (rngs is None) == (params is None):
            raise ValueError(f"{type(self).__name__}: pass exactly one of rngs= (random init) "
                             "or params= (a params pytree)")
        if params is None:
            params = transformer.init_params(config, rngs.params(), dtype)
        self.config = config
        self.contract = contract if contract is not None else NumericalContract()
        self.embed = Embed(params["embed"])
        self.layers = DecoderLayers(config, params["layers"])
        self.final_norm = RMSNorm(params["final_norm"], config.rms_norm_eps)
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None

    def hidden(self, tokens: jax.Array, *, mask: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
        """Final-norm hidden states [B, T, D] (compute dtype) of a right-padded batch."""
        batch, seq = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        if mask is None:
            mask = jnp.ones((batch, seq), bool)
        h = self.embed(tokens, self.contract)
        h = self.layers(h, self.contract, positions.astype(jnp.int32), mask)
        return self.final_norm(h, self.contract)

    def __call__(self, tokens: jax.Array, *, mask: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V] float32; the output layer is lm_head or the tied embedding."""
        head = ({"lm_head": _value(self.lm_head)} if self.lm_head is not None
                else {"embed": _value(self.embed.embedding)})
        return transformer.logits_from_hidden(head, self.hidden(tokens, mask=mask,
                                                                positions=positions),
                                              contract=self.contract)


class Llama(Decoder):
    model_type = "llama"


class Qwen2(Decoder):
    model_type = "qwen2"


class Qwen3(Decoder):
    model_type = "qwen3"


def params_of(model: Decoder) -> dict:
    """The model's weights as the plain params pytree of transformer.param_shapes (the same
    arrays, no copy)."""
    params = {"embed": _value(model.embed.embedding), "layers": model.layers.weights(),
              "final_norm": _value(model.final_norm.weight)}
    if model.lm_head is not None:
        params["lm_head"] = _value(model.lm_head)
    return params


def from_params(config: ModelConfig, params: dict, *,
                contract: NumericalContract | None = None) -> Decoder:
    """A Decoder holding `params` (a pytree of transformer.param_shapes(config))."""
    expected = transformer.param_shapes(config)
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if got != expected:
        raise ValueError(f"from_params: the params do not match config {config.model_type!r}: "
                         f"expected shapes {expected}, got {got}")
    return Decoder(config, params=params, contract=contract)
