"""Decoder-only LM (Llama, Qwen2, Qwen3, Qwen3.5, Qwen3-MoE, Qwen3.5-MoE) as pure functions of
an explicit param pytree.

Every matmul, attention, norm, delta rule, expert and the output logprob go through
jrl.kernels with one numerical contract, and one `forward_hidden` serves both uses: full
sequences (train) and cached decoding (prefill, decode and append continue from a per-slot
cache). Because the kernels are batch-invariant and stage-consistent, a token's logprob has the
same bits in all three stages.

A layer is a token mixer (jrl.models.blocks.attention or .deltanet) and an MLP (blocks.mlp or
blocks.moe), each behind its pre-norm. Params are plain nested dicts (see `param_shapes`),
weights stored [in, out] so y = x @ w, the layers of one kind stacked on a leading axis so the
schedule runs under one `lax.scan`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models import lora
from jrl.models.blocks import attention, deltanet, mlp, moe
from jrl.models.blocks.attention import rope  # noqa: F401  (re-exported: the RoPE of every family)
from jrl.models.blocks.norms import norm, prologue
from jrl.models.config import KIND_PARAM_KEYS, ModelConfig

Params = dict


# ---------------------------------------------------------------------------------------------
# Parameters

_MIXERS = {"attention": attention, "deltanet": deltanet}


def kind_param_shapes(config: ModelConfig, kind: tuple[str, str], n: int) -> dict:
    """Shapes of a stack of n layers of `kind` = (mixer, mlp): the mixer's params (with its
    input norm attn_norm), mlp_norm, and the MLP's."""
    mixer, mlp_kind = kind
    shapes = dict(_MIXERS[mixer].param_shapes(config, n))
    shapes["mlp_norm"] = (n, config.hidden_size)
    if mlp_kind == "dense":
        shapes.update(mlp.param_shapes(config, n))
    else:
        shapes.update(moe.param_shapes(config, n))
    return shapes


def param_shapes(config: ModelConfig) -> dict:
    """Shape of every parameter, same structure as the params pytree.

    {"embed": [V, D], KIND_PARAM_KEYS[kind]: {name: [n_kind, ...]} for each layer kind (a
    dense softmax-attention model has one, "layers"), "final_norm": [D], "lm_head": [D, V] when
    not tied}. Layers of one kind are stacked in layer order on a leading axis. With
    config.lora, each adapted weight `name` [n, K, N] has `name_lora_a` [n, K, r] and
    `name_lora_b` [n, r, N] next to it (jrl.models.lora).
    """
    d, v = config.hidden_size, config.vocab_size
    shapes = {"embed": (v, d)}
    for kind in config.kinds:
        shapes[KIND_PARAM_KEYS[kind]] = kind_param_shapes(config, kind, config.kind_count(kind))
    shapes["final_norm"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return lora.with_adapter_shapes(config, shapes)


def lora_weights(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """{KIND_PARAM_KEYS[kind]: the weight names that carry adapters} (jrl.models.lora)."""
    return lora.adapted_weights(config, param_shapes(config.replace(lora=None)))


def num_params(config: ModelConfig) -> int:
    """Parameters of the model (all experts and adapters counted)."""
    return sum(math.prod(shape) for shape in jax.tree.leaves(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)))


def _init_leaf(name: str, shape: tuple, key: jax.Array, config: ModelConfig, dtype):
    if lora.is_adapter(name):
        return lora.init_adapter(name, shape, key, dtype)
    if name.endswith("norm"):
        # Zero-centred norms (norm_offset 1) start at scale 1 + 0; the DeltaNet's gated norm
        # uses its weight plainly.
        value = 1.0 if name == "delta_norm" or config.norm_offset == 0.0 else 0.0
        return jnp.full(shape, value, dtype)
    if name in ("bq", "bk", "bv"):
        return jnp.zeros(shape, dtype)
    if name == "dt_bias":
        return jnp.ones(shape, dtype)
    if name == "A_log":
        # transformers: A ~ U(0.01, 16), A_log = log A (decay rates away from 0 and infinity).
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)
    residual_out = name in ("wo", "w_down", "w_out", "experts_down", "shared_down")
    std = 0.02 / (2 * config.num_layers) ** 0.5 if residual_out else 0.02
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> Params:
    """Random init: normal(0, 0.02) weights (scaled down for residual outputs), ones for norms
    (zeros for zero-centred ones), zeros for biases, transformers' A_log / dt_bias for Gated
    DeltaNet; LoRA adapters as jrl.models.lora.init_adapter (B = 0)."""
    return init_tree(param_shapes(config), config, rng, dtype)


def init_tree(shapes: dict, config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> Params:
    """Random leaves for a tree of shapes ({name: shape tuple}, nested), by init_params' rules
    for each leaf's name; one key per leaf, split from rng in flattening order."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(rng, len(flat))
    leaves = [_init_leaf(path[-1].key, shape, key, config, dtype)
              for key, (path, shape) in zip(keys, flat)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------------------
# Cache


class Cache(NamedTuple):
    """What cached decoding keeps per slot, for every layer kind.

    layers: KIND_PARAM_KEYS[kind] -> {name: [n_kind, B, ...]} (attention: k, v [n, B, C, Hkv,
    hd] in the compute dtype, index along C == token position; Gated DeltaNet: conv, state and
    the current chunk's inputs, see jrl.models.blocks.deltanet), zero-initialised. lengths [B]
    int32: the number of filled positions per slot (attention entries at index >= length are
    invalid and may hold stale data). Every array has the slot axis at position 1, so slots
    are gathered and scattered with one tree_map (select_rows / scatter_rows).
    """

    layers: dict
    lengths: jax.Array


def init_cache(config: ModelConfig, batch: int, capacity: int,
               contract: NumericalContract) -> Cache:
    layers = {}
    for kind in config.kinds:
        shapes = _MIXERS[kind[0]].cache_shapes(config, config.kind_count(kind), batch, capacity,
                                               contract)
        layers[KIND_PARAM_KEYS[kind]] = {name: jnp.zeros(shape, dtype)
                                         for name, (shape, dtype) in shapes.items()}
    return Cache(layers, jnp.zeros((batch,), jnp.int32))


def select_rows(cache: Cache, rows: jax.Array) -> Cache:
    """The caches of slots `rows` [k] (a gather): a Cache of batch k."""
    return Cache(jax.tree.map(lambda x: x[:, rows], cache.layers), cache.lengths[rows])


def scatter_rows(cache: Cache, slots: jax.Array, rows: Cache) -> Cache:
    """`cache` with the k row caches `rows` written into `slots` [k] (entries == batch are
    padding: dropped)."""
    return Cache(jax.tree.map(lambda c, r: c.at[:, slots].set(r, mode="drop"), cache.layers,
                              rows.layers),
                 cache.lengths.at[slots].set(rows.lengths, mode="drop"))


# ---------------------------------------------------------------------------------------------
# Forward


def _layer(h, layer, cache, route, *, kind, config, contract, positions, mask, lengths,
           rotary=None, mask_plan=None, router_probs=False, expert_axis=None, pending=False,
           tensor_axis=None):
    """One decoder block of `kind`. h [B, T, D]; cache: this layer's cache entries or None;
    route: [B, T, k] experts to replay (MoE layers) or None. Returns (h, cache, routing) with
    routing None (dense), experts [B, T, k], or (experts, probs [B, T, E]) with router_probs."""
    mixer, mlp_kind = kind
    # Each mixer and the dense MLP norm their input inside their first projections' kernel.
    extra = {"pending": True} if pending and mixer == "deltanet" else {}
    if mixer == "attention":
        extra.update(rotary=rotary, mask_plan=mask_plan)
    y, cache = _MIXERS[mixer].forward(h, layer, cache, config=config, contract=contract,
                                      positions=positions, mask=mask, lengths=lengths,
                                      input_norm=prologue(layer["attn_norm"], config),
                                      tensor_axis=tensor_axis, **extra)
    h = h + y.astype(h.dtype)
    experts = None
    if mlp_kind == "dense":
        y = mlp.forward(h, layer, contract=contract, config=config,
                        input_norm=prologue(layer["mlp_norm"], config), tensor_axis=tensor_axis)
    else:
        x = norm(h, layer["mlp_norm"], config, contract)
        y, experts, probs = moe.forward(x, layer, config=config, contract=contract,
                                        routes=route, expert_axis=expert_axis)
        if router_probs:
            experts = (experts, probs)
    return h + y.astype(h.dtype), cache, experts


def _period(kinds: tuple) -> int:
    """The shortest p such that the layer kinds repeat with period p (len(kinds) if none)."""
    n = len(kinds)
    for p in range(1, n + 1):
        if n % p == 0 and kinds == kinds[:p] * (n // p):
            return p
    return n


def _run_layers(h, params, cache_layers, routes, config, layer_fn, carry_caches=True):
    """Runs every layer in order. Layers of one kind share a stack; the schedule runs as one
    lax.scan over repeats of the kinds' period (one compiled period: a dense model scans its
    single stack, Qwen3.5 scans [3 x DeltaNet, attention] blocks; a schedule that does not
    repeat is one period). cache_layers / routes: per-kind stacks [n_kind, ...] or None.
    Returns (h, new cache layers or None, routing: {moe kind key: [n_kind, ...]} of each MoE
    layer's routing record (layer_fn's, stacked leaf by leaf)).

    With carry_caches, attention caches are not scanned over but carried whole: a layer gets
    its kind's stacks and its index ({"k", "v", "layer"}), writes its new keys into them in
    place and attends over them where they lie. Scanned, XLA copied each layer's cache out of
    the stack and into the output stack at every call, a cost that grew with the cache's
    capacity (at SmolLM2 dims on 32 slots, about half of a decode forward at capacity 128, on
    the CPU)."""
    kinds = config.layer_kinds
    period = _period(kinds)
    repeats = len(kinds) // period
    pattern = kinds[:period]
    keys = [KIND_PARAM_KEYS[k] for k in config.kinds]
    moe_keys = [KIND_PARAM_KEYS[k] for k in config.kinds if k[1] == "moe"]
    per_period = {KIND_PARAM_KEYS[k]: pattern.count(k) for k in config.kinds}
    has_cache = cache_layers is not None
    carried = {KIND_PARAM_KEYS[k] for k in config.kinds
               if has_cache and carry_caches and k[0] == "attention"}

    # A kind with one layer per period is scanned over its stack as it is: reshaping it to
    # [repeats, 1, ...] gave the size-1 dim its own layout in XLA, which then copied every
    # stacked weight and cache of that kind at each call (the whole model per decode step).
    def split(tree, key):   # [n_kind, ...] -> [repeats, per_period, ...]
        if per_period[key] == 1:
            return tree
        return jax.tree.map(lambda x: x.reshape((repeats, per_period[key]) + x.shape[1:]), tree)

    def merge(tree, key):   # back to [n_kind, ...]
        if per_period[key] == 1:
            return tree
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)

    xs = {key: (split(params[key], key),
                split(cache_layers[key], key) if has_cache and key not in carried else None,
                split(routes[key], key) if routes is not None and key in moe_keys else None)
          for key in keys}

    def body(carry, xs):
        h, stacks = carry
        xs, repeat = xs
        stacks = dict(stacks)
        seen = {key: 0 for key in keys}
        caches = {key: [] for key in keys if key not in carried}
        experts = {key: [] for key in moe_keys}
        for kind in pattern:
            key = KIND_PARAM_KEYS[kind]
            stack, cache_stack, route_stack = xs[key]
            j = seen[key]
            seen[key] += 1
            pick = lambda tree: tree if tree is None or per_period[key] == 1 else \
                jax.tree.map(lambda x: x[j], tree)
            layer_cache = (dict(stacks[key], layer=repeat * per_period[key] + j)
                           if key in carried else pick(cache_stack))
            h, layer_cache, layer_experts = layer_fn(h, pick(stack), layer_cache,
                                                     pick(route_stack), kind)
            if key in carried:
                stacks[key] = layer_cache
            elif has_cache:
                caches[key].append(layer_cache)
            if key in moe_keys:
                experts[key].append(layer_experts)
        def stack_all(items, key):
            if per_period[key] == 1:
                return items[0]
            return jax.tree.map(lambda *xs: jnp.stack(xs), *items)
        return (h, stacks), ({key: stack_all(items, key) for key, items in caches.items()}
                             if has_cache else None,
                             {key: stack_all(experts[key], key) for key in moe_keys})

    stacks = {key: cache_layers[key] for key in carried}
    (h, stacks), (new_caches, experts) = jax.lax.scan(
        body, (h, stacks), (xs, jnp.arange(repeats, dtype=jnp.int32)))
    if has_cache:
        new_caches = {key: stacks[key] if key in carried else merge(new_caches[key], key)
                      for key in keys}
    return (h, new_caches if has_cache else None,
            {key: merge(experts[key], key) for key in moe_keys})


class Forward(NamedTuple):
    """forward()'s result: hidden [B, T, D] (final norm, compute dtype), the new cache (or
    None), experts {moe kind key: [n_kind, B, T, k] int32}: every token's routing per MoE layer
    (the router's own top-k, also under replay; empty for dense models), router_probs {moe kind
    key: [n_kind, B, T, E] float32} (the router's softmax, differentiable) when asked for, else
    None."""

    hidden: jax.Array
    cache: Cache | None
    experts: dict
    router_probs: dict | None = None


def forward(params: Params, config: ModelConfig, tokens: jax.Array, *,
            contract: NumericalContract, positions: jax.Array | None = None,
            mask: jax.Array | None = None, cache: Cache | None = None,
            routes: dict | None = None, router_probs: bool = False,
            expert_axis: str | None = None, pending: bool = False,
            embeds: jax.Array | None = None, tensor_axis: str | None = None) -> Forward:
    """The decoder. tokens [B, T] int -> Forward(hidden, cache, experts).

    positions [B, T] default arange(T); mask [B, T] bool marks real tokens (default all; the
    real tokens of a row come first, right padding). With a cache, each real token's k/v is
    written at index = its position, `lengths` grows to cover them, and attention runs over the
    whole cache (capacity C) with the causal mask kv_position <= q_position; Gated DeltaNet
    layers continue from their cached state when the row's first position equals its cached
    length (or start over at position 0). Without one, attention runs over the sequence itself.
    routes: {moe kind key: [n_kind, B, T, k]} experts to replay instead of routing (R3).
    router_probs: also return every MoE layer's router probabilities (a load-balancing loss).
    expert_axis: expert parallelism inside shard_map (params' experts_* hold this device's
    share of the experts; see jrl.models.blocks.moe and jrl.parallel.expert).
    tensor_axis: tensor parallelism inside shard_map (params hold this device's heads and MLP
    columns, config counts them; dense MLPs, softmax attention and Gated DeltaNet; see
    jrl.parallel.tensor).
    pending (with a cache; T <= contract.delta_chunk): Gated DeltaNet layers return, instead of
    their new cache, the record `settle_cache` turns into the cache of any leading part of each
    row's tokens (a speculative verify pass keeps its accepted drafts). Attention layers'
    caches are the usual ones (entries past a row's length are invalid anyway).
    embeds [B, T, D]: the layers' input instead of params["embed"][tokens] (tokens then give
    only the shape; jrl.models.mtp feeds its projected input this way, with params that hold
    no embedding).
    """
    batch, seq = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    if mask is None:
        mask = jnp.ones((batch, seq), bool)
    positions = positions.astype(jnp.int32)
    h = (params["embed"][tokens] if embeds is None else embeds).astype(contract.compute)
    lengths = None
    if cache is not None:
        lengths = jnp.maximum(
            cache.lengths, jnp.max(jnp.where(mask, positions + 1, 0), axis=1)).astype(jnp.int32)

    # RoPE's tables and the attention mask's kernel layout once per forward, not per layer.
    # Not the tables on the CPU's emulated grid: there XLA's CPU cos and sin gave a table
    # computed outside the layer loop other bits in the train forward than in a decode step
    # (a kernel launch costs nothing there anyway).
    attention_kinds = [kind for kind in config.kinds if kind[0] == "attention"]
    native = contract.backend == "pallas" and not kernels.execution(contract).emulate_grid
    rotary = attention.model_rotary(config, positions) if attention_kinds and native else None
    mask_plan = None
    if attention_kinds and cache is not None:
        capacity = cache.layers[KIND_PARAM_KEYS[attention_kinds[0]]]["k"].shape[-3]
        mask_plan = kernels.attention_plan(positions, *attention.cache_visibility(
            lengths, capacity), contract=contract)

    def layer_fn(h, layer, layer_cache, route, kind):
        return _layer(h, layer, layer_cache, route, kind=kind, config=config, contract=contract,
                      positions=positions, mask=mask, lengths=lengths, rotary=rotary,
                      mask_plan=mask_plan,
                      router_probs=router_probs, expert_axis=expert_axis, pending=pending,
                      tensor_axis=tensor_axis)

    # XLA's CPU backend widens a whole bfloat16 buffer for each dynamic slice or in-place write
    # (jrl.kernels._grid): writing bfloat16 stacks in place made a 32-slot SmolLM2 decode
    # forward 2-4x slower there, so on a CPU bfloat16 caches stay scanned layer by layer.
    carry_caches = not (jnp.dtype(contract.compute) == jnp.bfloat16
                        and contract.resolved_platform() == "cpu")
    h, layers, routing = _run_layers(h, params, None if cache is None else cache.layers, routes,
                                     config, layer_fn, carry_caches)
    h = norm(h, params["final_norm"], config, contract)
    probs = None
    if router_probs:
        routing, probs = ({k: v[0] for k, v in routing.items()},
                          {k: v[1] for k, v in routing.items()})
    return Forward(h, None if cache is None else Cache(layers, lengths), routing, probs)


# ---------------------------------------------------------------------------------------------
# Routes: one array per token for every MoE layer


def moe_layers(config: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(kind key, index in that kind's stack) of each MoE layer, in layer order: the L_moe
    columns of a routes array."""
    seen: dict[str, int] = {}
    out = []
    for kind in config.layer_kinds:
        key = KIND_PARAM_KEYS[kind]
        if kind[1] == "moe":
            out.append((key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return tuple(out)


def stack_routes(experts: dict, config: ModelConfig) -> jax.Array:
    """Forward.experts {kind key: [n_kind, B, T, k]} -> routes [B, T, L_moe, k] int32, MoE layers
    in layer order (the layout the sampler records and a TrainBatch carries: rows first, so it
    splits over devices and micro-batches like every other batch field)."""
    columns = [experts[key][j] for key, j in moe_layers(config)]
    return jnp.stack(columns, axis=2).astype(jnp.int32)


def split_routes(routes: jax.Array, config: ModelConfig) -> dict:
    """routes [B, T, L_moe, k] -> {kind key: [n_kind, B, T, k]}, the inverse of stack_routes (the
    form `forward(routes=...)` takes)."""
    layers = moe_layers(config)
    if routes.ndim != 4 or routes.shape[2] != len(layers) or \
            routes.shape[3] != config.num_experts_per_tok:
        raise ValueError(f"routes: expected [B, T, {len(layers)} MoE layers, "
                         f"{config.num_experts_per_tok} experts], got {routes.shape}")
    out: dict[str, list] = {}
    for column, (key, _) in enumerate(layers):
        out.setdefault(key, []).append(routes[:, :, column])
    return {key: jnp.stack(items) for key, items in out.items()}


def settle_cache(config: ModelConfig, pending: Cache, cache: Cache, keep: jax.Array) -> Cache:
    """The cache of forward(..., cache=cache) had only the first keep [B] real tokens of each
    row been fed, from forward(..., cache=cache, pending=True)'s `pending` cache (see
    deltanet.settle; bit for bit that call's cache, with no second forward). Attention entries
    come back as the pending call wrote them; lengths are the pending call's, so the caller
    sets the kept ones (attention entries at index >= length are invalid)."""
    layers = dict(pending.layers)
    for kind in config.kinds:
        if kind[0] == "deltanet":
            key = KIND_PARAM_KEYS[kind]
            layers[key] = jax.vmap(deltanet.settle, in_axes=(0, 0, None))(
                pending.layers[key], cache.layers[key], keep)
    return Cache(layers, pending.lengths)


def forward_hidden(params: Params, config: ModelConfig, tokens: jax.Array, *,
                   contract: NumericalContract, positions: jax.Array | None = None,
                   mask: jax.Array | None = None, cache: Cache | None = None):
    """(hidden, cache) of `forward` (see there), for callers that need no routing."""
    out = forward(params, config, tokens, contract=contract, positions=positions, mask=mask,
                  cache=cache)
    return out.hidden, out.cache


def logits_from_hidden(params: Params, hidden: jax.Array, *, contract: NumericalContract):
    """hidden [..., D] -> logits [..., V] in float32 (matmul kernel, float32 output)."""
    if "lm_head" in params:
        logits = kernels.matmul(hidden, params["lm_head"], contract=contract)
    else:
        # Tied: the [V, D] embedding read in place (no transposed copy of it per call).
        logits = kernels.matmul(hidden, params["embed"], contract=contract, transpose_w=True)
    return logits.astype(jnp.float32)


def forward_logits(params: Params, config: ModelConfig, tokens: jax.Array, *,
                   contract: NumericalContract, mask: jax.Array | None = None,
                   positions: jax.Array | None = None) -> jax.Array:
    """Full-sequence logits for a right-padded batch. tokens [B, T] -> [B, T, V] float32."""
    hidden, _ = forward_hidden(params, config, tokens, contract=contract, positions=positions,
                               mask=mask)
    return logits_from_hidden(params, hidden, contract=contract)


class SequenceScores(NamedTuple):
    """sequence_scores()'s result: logp, entropy [B, T] float32 (see sequence_logprobs) and
    routes [B, T, L_moe, k] int32, the router's own experts of every token in every MoE layer
    (L_moe = 0 for a dense model); router_probs [B, T, L_moe, E] float32 (differentiable) when
    asked for, else None."""

    logp: jax.Array
    entropy: jax.Array
    routes: jax.Array
    router_probs: jax.Array | None = None


def sequence_scores(params: Params, config: ModelConfig, tokens: jax.Array, *,
                    contract: NumericalContract, mask: jax.Array | None = None,
                    temperature: float = 1.0, logit_floor: jax.Array | None = None,
                    routes: jax.Array | None = None, router_probs: bool = False,
                    expert_axis: str | None = None,
                    tensor_axis: str | None = None) -> SequenceScores:
    """sequence_logprobs plus the routing of every token (see SequenceScores).

    routes [B, T, L_moe, k] (stack_routes' layout): replay these experts (R3) where a token's
    entry is >= 0, route the others from their logits; None routes everything.
    router_probs: also return the router probabilities (MoE models only). expert_axis: expert
    parallelism, tensor_axis: tensor parallelism, inside shard_map (see forward).
    """
    batch, seq = tokens.shape
    if router_probs and not config.has_moe:
        raise ValueError(f"sequence_scores(router_probs=True): {config.model_type} has no MoE "
                         "layers")
    out = forward(params, config, tokens, contract=contract, mask=mask,
                  routes=None if routes is None or not config.has_moe
                  else split_routes(routes, config), router_probs=router_probs,
                  expert_axis=expert_axis, tensor_axis=tensor_axis)
    logits = logits_from_hidden(params, out.hidden, contract=contract)
    floor = None if logit_floor is None else logit_floor[:, 1:]
    logp, entropy = kernels.token_logprobs(logits[:, :-1], tokens[:, 1:], contract=contract,
                                           temperature=temperature, logit_floor=floor)
    zero = jnp.zeros((batch, 1), jnp.float32)
    experts = (stack_routes(out.experts, config) if config.has_moe
               else jnp.zeros((batch, seq, 0, max(config.num_experts_per_tok, 1)), jnp.int32))
    probs = (jnp.stack([out.router_probs[key][j] for key, j in moe_layers(config)], axis=2)
             if router_probs else None)
    return SequenceScores(jnp.concatenate([zero, logp], axis=1),
                          jnp.concatenate([zero, entropy], axis=1), experts, probs)


def sequence_logprobs(params: Params, config: ModelConfig, tokens: jax.Array, *,
                      contract: NumericalContract, mask: jax.Array | None = None,
                      temperature: float = 1.0, logit_floor: jax.Array | None = None,
                      routes: jax.Array | None = None):
    """Per-token logprob and entropy of each next token, as the train step computes them.

    tokens [B, T], mask [B, T]. Returns (logp [B, T], entropy [B, T]) float32 where logp[:, t] is
    log pi(tokens[:, t] | tokens[:, :t]) for t >= 1 (logp[:, 0] = 0: nothing predicts the first
    token). logit_floor [B, T] replays the sampler's top-k/top-p truncation for token t. routes
    [B, T, L_moe, k]: MoE experts to replay (see sequence_scores).
    """
    scores = sequence_scores(params, config, tokens, contract=contract, mask=mask,
                             temperature=temperature, logit_floor=logit_floor, routes=routes)
    return scores.logp, scores.entropy

