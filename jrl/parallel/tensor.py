"""Tensor parallelism (TP) whose bits do not depend on its degree (docs/tensor_parallel.md).

    mesh = make_tensor_mesh(tensor=2)                         axes ("data", "tensor")
    score = make_tensor_parallel_score_fn(model_config, contract, mesh)
    score(params, tokens, attn_mask, logit_floor) -> SequenceScores

Each attention layer's heads, each Gated DeltaNet layer's key and value heads and each dense
MLP's intermediate columns are split over the "tensor" axis: a device computes its heads' q, k,
v (and the output gate) and attention, its heads' delta rule, and its columns of gate and up
(column-parallel: every output element is one device's, computed by the one-device matmul
tiles, as contract.matmul_block_n divides each device's columns: check_column_tiles). The
row-parallel projections (attention output, DeltaNet output, MLP down) reduce over the split
dimension: there the partial products are those of contract.tensor_shards virtual shards,
gathered and summed in shard order on every device (jrl.kernels.row_parallel), never by a
device-count-dependent psum. Norms, embeddings, the LM head and the logprob stay whole on every
device. So the logits, p_o and the entropy are those of one device running the same contract,
bit for bit, for every T that divides tensor_shards: a sampler at TP = 1 and a trainer at TP =
2 or 4 agree (tests/parallel/test_tensor_parallel.py).

Gated DeltaNet's w_qkv and conv hold [q (all key heads) | k (all key heads) | v (all value
heads)] columns, so a contiguous split would give a device the wrong heads:
tensor_parallel_params first permutes them into per-device blocks [q_t | k_t | v_t] (device t's
key heads t * Hk / T .. and value heads t * Hv / T .., which read exactly those key heads:
value head h reads key head h // (Hv / Hk)), and the score function does so before sharding.
The small w_a and w_b (one column per value head) stay whole; each device takes its heads of
a, b, dt_bias and A_log (jrl.models.blocks.deltanet).

What is here: the forward of dense-MLP models with softmax attention (Llama, Qwen2, Qwen3) or
Qwen3.5's hybrid of Gated DeltaNet and gated attention, the train engine's scores (p_o,
entropy). Not yet: gradients under TP (the column-parallel backward sums over the split heads
too and needs the same ordered reduction), MoE layers (expert parallelism, jrl.parallel.expert,
covers them) and LoRA adapters.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.kernels import execution
from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import KIND_PARAM_KEYS, ModelConfig
from jrl.models.sharding import DEFAULT_RULES, MeshAxes, param_partition_specs
from jrl.parallel.mesh import data_by_axis_mesh

TENSOR_AXIS = "tensor"
TP_AXES = ("data", TENSOR_AXIS)
# Heads and MLP columns over "tensor", rows over "data", everything else whole. Gated
# DeltaNet's q/k/v columns split after tensor_parallel_params' permutation; its per-head
# "linear_heads" params (w_a, w_b, dt_bias, A_log) stay whole (see the module docstring).
TENSOR_PARALLEL_RULES: dict[str, MeshAxes] = {
    **{name: None for name in DEFAULT_RULES}, "batch": "data",
    "heads": TENSOR_AXIS, "kv_heads": TENSOR_AXIS, "mlp": TENSOR_AXIS,
    "linear_qkv": TENSOR_AXIS, "linear_value": TENSOR_AXIS}
# The DeltaNet weights whose columns are [q | k | v] (tensor_parallel_params permutes them).
_QKV_COLUMNS = ("w_qkv", "conv")


def make_tensor_mesh(tensor: int, devices: Sequence[jax.Device] | None = None, *,
                     data: int = 1) -> Mesh:
    """A Mesh with axes ("data", "tensor") of shape (data, tensor) over the first
    data * tensor of `devices` (default jax.devices()), in order."""
    return data_by_axis_mesh(TENSOR_AXIS, tensor, devices, data=data)


def local_config(config: ModelConfig, tensor: int) -> ModelConfig:
    """The config one device of a degree-`tensor` TP runs: its share of the query and KV heads,
    of the Gated DeltaNet key and value heads and of the MLP columns. Raises naming the model
    and what does not split."""
    if config.has_moe or config.lora is not None:
        raise ValueError(f"tensor parallelism: models with dense MLPs and without adapters "
                         f"only; {config.model_type} has MoE layers or LoRA "
                         "(jrl.parallel.tensor's docstring says what is not yet covered)")
    counts = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
              "intermediate_size": config.intermediate_size}
    if config.has_deltanet:
        counts.update(linear_num_key_heads=config.linear_num_key_heads,
                      linear_num_value_heads=config.linear_num_value_heads)
    for name, value in counts.items():
        if value % tensor:
            raise ValueError(f"tensor parallelism of degree {tensor}: {name}={value} does not "
                             "split over it")
    return config.replace(**{name: value // tensor for name, value in counts.items()})


def qkv_column_order(config: ModelConfig, tensor: int) -> np.ndarray:
    """[conv_size] int: the Gated DeltaNet [q | k | v] columns in per-device order, device t's
    block [q_t | k_t | v_t] (its key heads' q and k columns, its value heads' v columns) after
    device t-1's, so that a contiguous split over `tensor` devices gives each one its heads in
    the layout of local_config(config, tensor)."""
    key_size, value_size = config.linear_key_size, config.linear_value_size
    q, k, v = (np.arange(start, start + size).reshape(tensor, -1) for start, size in
               ((0, key_size), (key_size, key_size), (2 * key_size, value_size)))
    return np.concatenate([q, k, v], axis=1).reshape(-1)


def tensor_parallel_params(params: dict, config: ModelConfig, tensor: int) -> dict:
    """params with every Gated DeltaNet stack's w_qkv [n, D, conv_size] and conv [n, K,
    conv_size] columns in qkv_column_order (a copy; the same params at tensor = 1 or without
    DeltaNet layers). The layout tensor_param_specs splits; make_tensor_parallel_score_fn
    applies it itself."""
    if tensor == 1 or not config.has_deltanet:
        return params
    local_config(config, tensor)
    order = jnp.asarray(qkv_column_order(config, tensor))
    params = dict(params)
    for kind in config.kinds:
        if kind[0] == "deltanet":
            key = KIND_PARAM_KEYS[kind]
            params[key] = {name: (jnp.take(value, order, axis=-1) if name in _QKV_COLUMNS
                                  else value) for name, value in params[key].items()}
    return params


def tensor_param_specs(config: ModelConfig, mesh: Mesh) -> dict:
    """PartitionSpec of every param under TENSOR_PARALLEL_RULES (heads and MLP columns over
    "tensor"; Gated DeltaNet's in tensor_parallel_params' layout); raises naming the param
    when a dimension does not divide over the axis."""
    local_config(config, mesh.shape[TENSOR_AXIS])
    return param_partition_specs(config, TENSOR_PARALLEL_RULES,
                                 mesh_axis_sizes=dict(mesh.shape))


def check_column_tiles(config: ModelConfig, contract: NumericalContract, specs: dict,
                       tensor: int) -> None:
    """Raises unless contract.matmul_block_n divides every device's columns of every
    column-parallel weight (q, k, v, gate, up; Gated DeltaNet's z and each of its q, k and v
    sections of w_qkv, which tensor_parallel_params moves as blocks). Then a device runs
    exactly the one-device [block_m, K] x [K, block_n] tiles of its columns, at the same places
    in the same tiles; a tile narrower than block_n (a device's whole operand, e.g. under the
    CPU's whole-N default) is another dot shape, whose bits are the math library's choice
    (XLA's CPU dot gave columns of a [16, 256] x [256, 256] product other bits than the same
    columns of a [256, 64] slice)."""
    if tensor == 1:
        return
    shapes = transformer.param_shapes(config)
    widths = {}
    for kind in config.kinds:
        key = KIND_PARAM_KEYS[kind]
        for name, spec in specs[key].items():
            if len(shapes[key][name]) == 3 and spec[-1] == TENSOR_AXIS and name != "conv":
                widths[name] = shapes[key][name][-1] // tensor
    if "w_qkv" in widths:
        del widths["w_qkv"]
        widths["w_qkv q, k"] = config.linear_key_size // tensor
        widths["w_qkv v"] = config.linear_value_size // tensor
    block_n = contract.matmul_block_n
    if any(width % block_n for width in widths.values()):
        listed = ", ".join(f"{name} {width}" for name, width in sorted(widths.items()))
        raise ValueError(f"NumericalContract.matmul_block_n={block_n}: under tensor parallelism "
                         f"of degree {tensor} it must divide each device's columns of the "
                         f"column-parallel weights ({listed}), so that every device runs the "
                         "one-device matmul tiles")


def check_emulated_heads(config: ModelConfig, contract: NumericalContract, tensor: int) -> None:
    """Raises unless, on the CPU's emulated grid, contract.emulated_heads fixes the heads per step
    of the attention kernel (KV heads) and the Gated DeltaNet kernel (value heads) to a count
    dividing each device's share of them. Those kernels batch a step's dots over its heads, and
    XLA's CPU dots give a batch element bits that depend on the batch count: with all heads in
    one step, a device holding 1 / T of them ran other dots than one device (up to 4.8e-7 apart
    in an attention output). GPU and TPU kernels run one head per program: nothing to check."""
    if tensor == 1 or not execution(contract).emulate_grid:
        return
    shares = {"KV heads": config.num_kv_heads // tensor}
    if config.has_deltanet:
        shares["Gated DeltaNet value heads"] = config.linear_num_value_heads // tensor
    heads = contract.emulated_heads
    for what, share in shares.items():
        if heads == 0 or share % heads:
            raise ValueError(f"NumericalContract.emulated_heads={heads}: under tensor "
                             f"parallelism of degree {tensor} on the CPU's emulated grid it must "
                             f"divide each device's {share} {what} (e.g. 1), so that every "
                             "device runs the one-device kernel steps")


def make_tensor_parallel_score_fn(config: ModelConfig, contract: NumericalContract, mesh: Mesh,
                                  *, temperature: float = 1.0) -> Callable:
    """(params, tokens, attn_mask, logit_floor) -> transformer.SequenceScores, the train
    engine's scores (jrl.train.make_score_fn's) with heads and MLP columns split over the
    mesh's "tensor" axis and rows over "data" (B a multiple of the data size); params in the
    model's own layout (Gated DeltaNet columns are permuted here: tensor_parallel_params).
    Forward only. The mesh's tensor size must divide contract.tensor_shards,
    contract.matmul_block_n each device's columns (check_column_tiles) and, on the CPU,
    contract.emulated_heads each device's heads (check_emulated_heads), on the Pallas
    backend; the xla backend runs plain TP, a psum: the control. Run under jax.jit."""
    tensor = mesh.shape[TENSOR_AXIS]
    if contract.backend == "pallas" and contract.tensor_shards % tensor:
        raise ValueError(f"NumericalContract.tensor_shards={contract.tensor_shards}: must be a "
                         f"multiple of the mesh's tensor size {tensor}")
    specs = tensor_param_specs(config, mesh)
    if contract.backend == "pallas":
        check_column_tiles(config, contract, specs, tensor)
        check_emulated_heads(config, contract, tensor)
    shard_config = local_config(config, tensor)
    rows = PartitionSpec("data")
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                             is_leaf=lambda x: isinstance(x, PartitionSpec))

    def local(params, tokens, attn_mask, logit_floor):
        return transformer.sequence_scores(params, shard_config, tokens, contract=contract,
                                           mask=attn_mask, temperature=temperature,
                                           logit_floor=logit_floor, tensor_axis=TENSOR_AXIS)

    def score(params, tokens, attn_mask, logit_floor):
        if tokens.shape[0] % mesh.shape["data"]:
            raise ValueError(f"tensor-parallel scores: {tokens.shape[0]} rows do not split over "
                             f"data = {mesh.shape['data']} devices")
        params = jax.lax.with_sharding_constraint(
            tensor_parallel_params(params, config, tensor), shardings)
        sharded = jax.shard_map(local, mesh=mesh, in_specs=(specs, rows, rows, rows),
                                out_specs=rows, check_vma=False)
        return sharded(params, tokens, attn_mask, logit_floor)

    return score
