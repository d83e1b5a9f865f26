"""The row-parallel train step: bitwise equal to one device, with params and optimizer state
sharded (FSDP) and rows split over devices (data parallel).

Why not just jit jrl.train's step with shardings: XLA's partitioner then splits the kernels'
reductions (the weight gradient dw = x^T dy sums over rows) and the global gradient norm across
devices and all-reduces the partial results in an order of its own, so the update differs in the
last bits from one device (measured: 9 of 11 param leaves differ after 3 steps); and native
Mosaic (TPU) kernels cannot be partitioned automatically at all.

What this step does instead (docs/design.md, invariant 4: a reduction split across devices only where it
provably keeps the order):

- The global batch of B rows is cut into M micro-batches as jrl.train.make_train_step cuts it
  (micro-batch i = rows [i*B/M, (i+1)*B/M)). With N = data * fsdp row shards, the device at flat
  index d of ("data", "fsdp") takes micro-batches d, N + d, 2N + d, ... (M / N of them).
- Params are all-gathered (exact) and each device computes the gradient of its own micro-batch
  with the whole params, under shard_map: the same computation on the same rows as on one
  device, and the kernels are batch-invariant, so each micro-batch gradient has the same bits.
- Gradients are accumulated exactly as one device accumulates micro-batches,
  acc = (((0 + g_0) + g_1) + ... + g_{M-1}) in float32, but each device only for its own FSDP
  shard of every param: an all-to-all hands it its shard of every peer's micro-batch gradient,
  and it adds them one at a time in micro-batch order. Same additions, same order: same bits.
  (A psum / reduce-scatter would add in the collective's own, backend-dependent order.)
- The optimizer update runs on the sharded params and optimizer state (elementwise: sharding
  changes no bits) with the accumulated gradient replicated, so the global-norm clip reduces
  whole arrays exactly as on one device.

What is bitwise equal (tests/parallel/test_step.py, test_multiprocess.py):
- every mesh with data * fsdp > 1 and the same M: fsdp=4, data=4, data=2 x fsdp=2, fsdp=2,
  tensor=2, and 2 processes x 2 devices = 1 process x 4 devices (params, optimizer state,
  metrics);
- one device (this step on a 1-device mesh, or jrl.train.make_train_step with M micro-batches),
  thanks to two guards against XLA compiling the same micro-batch gradient differently in a
  program without collectives:
  1. the kernels' backward passes for attention and token logprobs run the plain-XLA reference,
     whose softmax normalisation is written `e * (1.0 / denom)`: XLA rewrites `e / denom` that
     way in some programs and not in others;
  2. jrl.train.make_train_step puts jax.lax.optimization_barrier on each micro-batch gradient
     before adding it: otherwise XLA folds the accumulator into the embedding gradient's
     scatter-add (acc + scatter_add(0, u) -> scatter_add(acc, u)), adding a repeated token's
     rows one by one into acc, an order no split across devices can reproduce.
These equalities rest on the backend compiling one micro-batch gradient to the same arithmetic
in different programs, so they are checked per backend: on the CPU they hold with XLA's default
fusion emitters and not with its older ones (`--xla_cpu_use_fusion_emitters=false`, with which
every mesh's gradients differ from the others' in the last bit; measured 2026-12, jax 0.10.2).
The tensor axis shards params and optimizer state (for memory); its devices repeat the same
row-parallel compute (no tensor-parallel kernels yet).

Memory per device during the step: the whole params (gathered once per step; a per-layer gather
needs a hook in jrl.models.transformer), one micro-batch gradient at full size, and the stacked
shards of all N peers' gradients (= one full gradient).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.models.sharding import MeshAxes, param_partition_specs
from jrl.parallel.rules import BATCH_AXES
from jrl.train.state import TrainBatch, TrainState
from jrl.train.step import (apply_update, combine_micro_metrics, make_logprob_fn,
                            make_micro_loss, make_score_fn)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def ordered_shard_sum(acc: jax.Array, grad: jax.Array, spec: PartitionSpec,
                      mesh_shape: Mapping[str, int],
                      batch_axes: tuple[str, ...] = BATCH_AXES) -> jax.Array:
    """Inside shard_map: acc + this device's shard (under `spec`) of the gradients of every
    device along `batch_axes`, added one at a time in flat device order (data-major).

    grad: this device's full-size partial gradient. acc: float32, this device's shard shape.
    Devices along axes of `spec` that are not batch axes (tensor) hold identical partials: they
    only take their block, nothing is summed over them.
    """
    x = grad
    labels: list[tuple[str, str | int]] = []   # per dim of x: ("block", axis) | ("data", dim)
    new_shape: list[int] = []
    for dim, size in enumerate(grad.shape):
        entry_axes = _axes(spec[dim]) if dim < len(spec) else ()
        ways = math.prod(mesh_shape[a] for a in entry_axes)
        for axis in entry_axes:
            labels.append(("block", axis))
            new_shape.append(mesh_shape[axis])
        labels.append(("data", dim))
        new_shape.append(size // ways)
    x = x.reshape(new_shape)
    # Non-batch axes (tensor): keep this device's block.
    for axis in [a for kind, a in labels if kind == "block" and a not in batch_axes]:
        pos = labels.index(("block", axis))
        x = jax.lax.dynamic_index_in_dim(x, jax.lax.axis_index(axis), pos, keepdims=False)
        del labels[pos]
    # Batch axes that shard this param: all-to-all; afterwards that dim indexes the source peer.
    for axis in [a for kind, a in labels if kind == "block"]:
        pos = labels.index(("block", axis))
        x = jax.lax.all_to_all(x, axis, pos, pos, tiled=False)
        labels[pos] = ("peer", axis)
    # Batch axes the param is replicated over: gather every peer's (same-shard) partial.
    for axis in batch_axes:
        if ("peer", axis) not in labels:
            x = jax.lax.all_gather(x, axis, axis=0, tiled=False)
            labels.insert(0, ("peer", axis))
    order = ([labels.index(("peer", a)) for a in batch_axes]
             + [i for i, (kind, _) in enumerate(labels) if kind == "data"])
    x = jnp.transpose(x, order)
    num_peers = math.prod(mesh_shape[a] for a in batch_axes)
    x = x.reshape((num_peers,) + acc.shape)
    # One addition per peer, in flat device order = micro-batch order.
    return jax.lax.fori_loop(0, num_peers, lambda i, a: a + x[i].astype(jnp.float32), acc)


def make_parallel_train_step(config: ModelConfig, contract: NumericalContract,
                             loss_fn: Callable, optimizer: optax.GradientTransformation,
                             mesh: Mesh, *, num_micro_batches: int | None = None,
                             temperature: float = 1.0, with_reference: bool = False,
                             rules: Mapping[str, MeshAxes] | None = None,
                             replay: bool = False) -> Callable:
    """Builds train_step(state, batch: TrainBatch) -> (state, metrics) for `mesh`, bitwise equal
    to jrl.train.make_train_step(config, contract, loss_fn, optimizer,
    num_micro_batches=num_micro_batches, temperature=temperature, with_reference=with_reference)
    on one device (see the module docstring for what that equality needs).

    num_micro_batches: M, default data * fsdp (one micro-batch per row shard); must be a multiple
      of data * fsdp, and the batch's row count a multiple of M.
    Run it under jit with the shardings of train_state_shardings / batch_sharding (use
    jrl.parallel.shard_train_step). Needs the Pallas backend for bitwise equality (the xla
    backend is not batch-invariant, so per-micro-batch gradients already differ).
    """
    if config.lora is not None:
        raise ValueError("make_parallel_train_step: LoRA adapters (model.lora.rank > 0) train on "
                         "one device for now; set pipeline.train_devices to 0 or 1")
    for axis in ("data", "fsdp", "tensor"):
        if axis not in mesh.shape:
            raise ValueError(f"make_parallel_train_step: mesh axes {tuple(mesh.shape)} lack "
                             f"{axis!r}; build the mesh with jrl.parallel.make_mesh")
    mesh_shape = dict(mesh.shape)
    num_shards = mesh_shape["data"] * mesh_shape["fsdp"]
    micro = num_shards if num_micro_batches is None else num_micro_batches
    if not isinstance(micro, int) or micro <= 0 or micro % num_shards:
        raise ValueError(f"make_parallel_train_step: num_micro_batches={num_micro_batches!r} "
                         f"must be a positive multiple of data * fsdp = {num_shards} (each row "
                         "shard computes whole micro-batches)")
    micros_per_device = micro // num_shards
    specs = param_partition_specs(config, rules, mesh_axis_sizes=mesh_shape)
    param_specs_flat, params_treedef = jax.tree.flatten(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    shard_shapes = [NamedSharding(mesh, spec).shard_shape(tuple(shape)) for spec, shape in zip(
        param_specs_flat, jax.tree.leaves(transformer.param_shapes(config),
                                          is_leaf=lambda x: isinstance(x, tuple)))]
    replicated = NamedSharding(mesh, PartitionSpec())

    micro_loss = make_micro_loss(config, contract, loss_fn, temperature=temperature,
                                 with_reference=with_reference, replay=replay)
    grad_fn = jax.grad(micro_loss, has_aux=True)

    def per_device(params, micros: TrainBatch, num_tokens, num_sequences):
        """params: whole; micros: [M / N, 1, R, ...] this device's micro-batches in order.
        Returns (this device's f32 shard of the summed gradient, metrics [M / N, 1])."""
        micros = jax.tree.map(lambda x: x[:, 0], micros)
        acc = [jnp.zeros(shape, jnp.float32) for shape in shard_shapes]

        def accumulate(acc, micro_batch):
            grads, metrics = grad_fn(params, micro_batch, num_tokens, num_sequences)
            # Keep the gradient whole before it is summed: else XLA may fold the accumulator into
            # its last op (acc + scatter_add(0, u) -> scatter_add(acc, u) for the embedding),
            # which changes the addition order, and only where no collective sits in between.
            grads = jax.lax.optimization_barrier(grads)
            acc = [ordered_shard_sum(a, g, spec, mesh_shape)
                   for a, g, spec in zip(acc, jax.tree.leaves(grads), param_specs_flat)]
            weight = jnp.sum(micro_batch.loss_mask).astype(jnp.float32)
            return acc, (metrics, weight)

        # A while loop whose trip count XLA cannot read (as in jrl.kernels._grid): never unrolled
        # or inlined, so the micro-batch gradient is compiled as a loop body whatever the number
        # of micro-batches per device; inlined, it would give XLA other code to rewrite it with.
        first = jax.tree.map(lambda x: x[0], micros)
        out_shape = jax.eval_shape(lambda m: accumulate(acc, m)[1], first)
        outputs = jax.tree.map(lambda s: jnp.zeros((micros_per_device,) + s.shape, s.dtype),
                               out_shape)

        def body(j, carry):
            acc, outputs = carry
            micro_batch = jax.tree.map(
                lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), micros)
            acc, out = accumulate(acc, micro_batch)
            outputs = jax.tree.map(
                lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, j, 0), outputs, out)
            return acc, outputs

        trip_count = jax.lax.optimization_barrier(jnp.int32(micros_per_device))
        acc, (metrics, weights) = jax.lax.fori_loop(jnp.int32(0), trip_count, body,
                                                    (acc, outputs))
        grads = jax.tree.unflatten(params_treedef, acc)
        return grads, jax.tree.map(lambda x: x[:, None], (metrics, weights))

    sharded_grads = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(None, BATCH_AXES), PartitionSpec(),
                  PartitionSpec()),
        out_specs=(specs, PartitionSpec(None, BATCH_AXES)),
        # Interpret-mode Pallas kernels do not support the varying-manual-axes check.
        check_vma=False)

    def train_step(state: TrainState, batch: TrainBatch):
        rows = batch.tokens.shape[0]
        if rows % micro:
            raise ValueError(f"batch of {rows} rows does not split into {micro} equal "
                             f"micro-batches (num_micro_batches, default data * fsdp)")
        num_tokens = jnp.sum(batch.loss_mask).astype(jnp.float32)
        num_sequences = jnp.sum(jnp.any(batch.loss_mask, axis=1)).astype(jnp.float32)
        # [B, ...] -> [M / N, N, R, ...]: micro-batch j * N + d sits at [j, d], on device d.
        micros = jax.tree.map(lambda x: x.reshape(
            (micros_per_device, num_shards, rows // micro) + x.shape[1:]), batch)
        whole_params = jax.lax.with_sharding_constraint(state.params, replicated)
        grads, (metrics, weights) = sharded_grads(whole_params, micros, num_tokens,
                                                  num_sequences)
        # [M / N, N] -> [M] in micro-batch order; replicated so every reduction over them
        # runs whole on each device, as on one device.
        metrics, weights = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda x: x.reshape(micro), (metrics, weights)), replicated)
        # A plain [M] array for _combine's sums: else XLA may fuse the reshape from [M / N, N]
        # into the reduction and add in a mesh-dependent order.
        metrics, weights = jax.lax.optimization_barrier((metrics, weights))
        metrics = combine_micro_metrics(metrics, weights)
        grads = jax.lax.with_sharding_constraint(grads, replicated)
        return apply_update(state, grads, optimizer, metrics, num_tokens)

    return train_step


def make_parallel_logprob_fn(config: ModelConfig, contract: NumericalContract, mesh: Mesh, *,
                             temperature: float = 1.0) -> Callable:
    """(params, tokens, attn_mask, logit_floor) -> (logp, entropy) [B, T], rows split over the
    mesh's ("data", "fsdp") devices under shard_map with the whole params on every device.

    Each device runs the same batch-invariant kernels on its rows, so the result is bitwise
    equal to the single-device jrl.train.make_logprob_fn (and to the sampler's p_b). B must be a
    multiple of data * fsdp.
    """
    logprob_fn = make_logprob_fn(config, contract, temperature=temperature)
    rows = PartitionSpec(BATCH_AXES)
    sharded = jax.shard_map(logprob_fn, mesh=mesh,
                            in_specs=(PartitionSpec(), rows, rows, rows),
                            out_specs=(rows, rows), check_vma=False)
    replicated = NamedSharding(mesh, PartitionSpec())

    def parallel_logprob_fn(params, tokens, attn_mask, logit_floor):
        params = jax.lax.with_sharding_constraint(params, replicated)
        return sharded(params, tokens, attn_mask, logit_floor)

    return parallel_logprob_fn


def make_parallel_score_fn(config: ModelConfig, contract: NumericalContract, mesh: Mesh, *,
                           temperature: float = 1.0, replay: bool = False) -> Callable:
    """make_score_fn (logp, entropy and the router's experts) with rows split over the mesh's
    ("data", "fsdp") devices as in make_parallel_logprob_fn: bitwise equal to one device.
    routes: [B, T, L_moe, k] when replay, else None."""
    score_fn = make_score_fn(config, contract, temperature=temperature, replay=replay)
    rows = PartitionSpec(BATCH_AXES)
    replicated = NamedSharding(mesh, PartitionSpec())

    def parallel_score_fn(params, tokens, attn_mask, logit_floor, routes=None):
        params = jax.lax.with_sharding_constraint(params, replicated)
        sharded = jax.shard_map(score_fn, mesh=mesh,
                                in_specs=(PartitionSpec(), rows, rows, rows,
                                          None if routes is None else rows),
                                out_specs=rows, check_vma=False)
        return sharded(params, tokens, attn_mask, logit_floor, routes)

    return parallel_score_fn
