"""Qwen3.5's multi-token-prediction (MTP) head, as a draft source for speculative decoding.

The head predicts the token after next from the target's final-norm hidden state h_t at
position t and the next token x_{t+1}:

    e = norm(embed[x_{t+1}], embed_norm)          (the target's embedding, the head's norm)
    g = norm(h_t, hidden_norm)
    u = [e, g] @ fc                               fc [2D, D]: embedding first, hidden second
    u = one decoder block (the target's attention kind: gated attention, dense MLP or MoE)
    o = norm(u, final_norm)                       -> logits o @ lm_head (the target's)

at position t (the positions are the hidden states', the tokens are shifted by one). Its
attention keeps a KV cache of its own over the positions fed so far. Chained drafts feed the
head's own output o back as the next step's h (as the checkpoint's serving engines do).

The head's params hold only its own weights (embed and lm_head are the target's):
    {"embed_norm": [D], "hidden_norm": [D], "fc": [2D, D],
     KIND_PARAM_KEYS[kind]: {name: [1, ...]} (one block, transformer's layout), "final_norm": [D]}
so the block runs through transformer.forward with `embeds` (one code path, the same kernels).
The head only proposes tokens: its bits never reach a sample's law or p_b, and it stays as the
checkpoint trained it while the policy trains (its acceptance may fall as the policy moves).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.blocks.norms import norm
from jrl.models.config import ModelConfig


class MtpHead(NamedTuple):
    """An MTP head's params (see the module docstring) for a target of a given config; it drafts
    as SpeculativeConfig(draft=MtpHead(params))."""

    params: dict


def block_config(config: ModelConfig) -> ModelConfig:
    """The one-block model the head's decoder block belongs to: the target's full-attention
    layer (with its MLP kind: MoE when the target's sparse layers are), no LoRA."""
    sparse = config.num_experts > 0
    return config.replace(num_layers=1,
                          layer_types=("full_attention",) if config.layer_types else (),
                          mlp_only_layers=() if sparse else config.mlp_only_layers,
                          decoder_sparse_step=1, lora=None)


def param_shapes(config: ModelConfig) -> dict:
    d = config.hidden_size
    block = transformer.param_shapes(block_config(config))
    shapes = {key: value for key, value in block.items()
              if key not in ("embed", "lm_head")}
    shapes.update(embed_norm=(d,), hidden_norm=(d,), fc=(2 * d, d))
    return shapes


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> dict:
    """A random head (transformer.init_params' rules; for tests and benchmarks)."""
    return transformer.init_tree(param_shapes(config), block_config(config), rng, dtype)


def check_params(head: dict, config: ModelConfig) -> None:
    """One clear message naming the first missing or misshapen entry of a head's params."""
    expected = param_shapes(config)

    def walk(want, got, path):
        if isinstance(want, dict):
            if not isinstance(got, dict):
                raise ValueError(f"MtpHead.params{path}: expected a dict, got "
                                 f"{type(got).__name__}")
            extra = sorted(set(got) - set(want))
            if extra:
                raise ValueError(f"MtpHead.params{path}: unexpected entries {extra}")
            for key, sub in want.items():
                if key not in got:
                    raise ValueError(f"MtpHead.params{path}: missing [{key!r}]")
                walk(sub, got[key], f"{path}[{key!r}]")
        elif not hasattr(got, "shape") or isinstance(got, dict):
            raise ValueError(f"MtpHead.params{path}: expected an array of shape {list(want)}, "
                             f"got {type(got).__name__}")
        elif tuple(got.shape) != tuple(want):
            raise ValueError(f"MtpHead.params{path} has shape {list(got.shape)}, expected "
                             f"{list(want)} for hidden_size {config.hidden_size}")

    walk(expected, head, "")


def init_cache(config: ModelConfig, batch: int, capacity: int,
               contract: NumericalContract) -> transformer.Cache:
    """The head's own KV cache (one attention layer), zero, lengths 0."""
    return transformer.init_cache(block_config(config), batch, capacity, contract)


def forward(head: dict, params: dict, config: ModelConfig, tokens: jax.Array,
            hidden: jax.Array, *, contract: NumericalContract,
            positions: jax.Array | None = None, mask: jax.Array | None = None,
            cache: transformer.Cache | None = None) -> tuple[jax.Array, transformer.Cache | None]:
    """The head over pairs (hidden[b, t], tokens[b, t]) = (h_i, x_{i+1}) at positions[b, t] = i.

    head: the head's params; params: the target's (embed, and lm_head for logits); tokens
    [B, T] int; hidden [B, T, D] (the target's final-norm hidden states, or the head's own
    output for a chained draft). positions, mask, cache as transformer.forward (the head's
    cache). Returns (o [B, T, D] in the compute dtype, the new cache or None)."""
    embedded = params["embed"][tokens].astype(contract.compute)
    e = norm(embedded, head["embed_norm"], config, contract)
    g = norm(hidden.astype(contract.compute), head["hidden_norm"], config, contract)
    u = kernels.matmul(jnp.concatenate([e, g], axis=-1), head["fc"], contract=contract)
    out = transformer.forward(head, block_config(config), tokens, contract=contract,
                              positions=positions, mask=mask, cache=cache, embeds=u)
    return out.hidden, out.cache


def logits(params: dict, head_hidden: jax.Array, *, contract: NumericalContract) -> jax.Array:
    """The head's output o [..., D] -> logits [..., V] float32, through the target's output
    layer."""
    return transformer.logits_from_hidden(params, head_hidden, contract=contract)
