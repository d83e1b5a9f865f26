"""Expert parallelism (EP): MoE experts split over an "expert" mesh axis, tokens moved by
all-to-all and combined on their home device, no cross-device sums (docs/design.md: MoE).

    mesh = make_expert_mesh(expert=4, devices=...)           axes ("data", "expert")
    specs = expert_param_specs(model_config, mesh)           experts_* split on their E axis
    score = make_expert_parallel_score_fn(model_config, contract, mesh)
    score(params, tokens, attn_mask, logit_floor, routes) -> SequenceScores

Every device is the home of its rows (rows split over ("data", "expert")) and holds E / P of each
MoE layer's experts plus a whole copy of every other param (router and shared expert included).
In each MoE layer a device routes its own tokens, sends each (token, j) pair's row to the peer
holding expert e_j, computes the rows it received, and gets the results back to combine in top-k
order (jrl.kernels.moe_experts_sharded). A row's result depends only on that row and its
expert's weights, so the logits are bitwise those of one device, for any EP size, and the
sampler on one device agrees with a trainer on EP = 4 bit for bit (tests/parallel).

What is here: the forward (train-engine scores: logp, entropy, the routes). Not yet: the
optimizer step under EP (the expert weights' gradients are local to their device; the
replicated params' need jrl.train.parallel_step's ordered sum across the expert axis too) and
the trainer / sampler wiring (a Trainer that builds this mesh).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.models.sharding import EXPERT_AXIS, EXPERT_PARALLEL_RULES, param_partition_specs
from jrl.parallel.mesh import data_by_axis_mesh

EP_BATCH_AXES = ("data", EXPERT_AXIS)


def make_expert_mesh(expert: int, devices: Sequence[jax.Device] | None = None, *,
                     data: int = 1) -> Mesh:
    """A Mesh with axes ("data", "expert") of shape (data, expert) over the first data * expert
    of `devices` (default jax.devices()), in order."""
    return data_by_axis_mesh(EXPERT_AXIS, expert, devices, data=data)


def expert_param_specs(config: ModelConfig, mesh: Mesh) -> dict:
    """PartitionSpec of every param under EXPERT_PARALLEL_RULES (experts_* split over "expert",
    the rest replicated); raises naming the param when E does not divide over the axis."""
    if not config.has_moe:
        raise ValueError(f"expert parallelism needs an MoE model; {config.model_type} has no MoE "
                         "layers")
    return param_partition_specs(config, EXPERT_PARALLEL_RULES,
                                 mesh_axis_sizes=dict(mesh.shape))


def expert_param_shardings(config: ModelConfig, mesh: Mesh) -> dict:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), expert_param_specs(config, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def make_expert_parallel_score_fn(config: ModelConfig, contract: NumericalContract, mesh: Mesh,
                                  *, temperature: float = 1.0, replay: bool = False) -> Callable:
    """(params, tokens, attn_mask, logit_floor, routes) -> transformer.SequenceScores, the train
    engine's scores (jrl.train.make_score_fn) with the experts split over the mesh's "expert"
    axis and the rows over ("data", "expert"). B must be a multiple of data * expert. routes:
    [B, T, L_moe, k] to replay when `replay`, else None. Run under jax.jit; params may live
    anywhere (they are resharded to expert_param_shardings)."""
    specs = expert_param_specs(config, mesh)
    rows = PartitionSpec(EP_BATCH_AXES)
    shardings = expert_param_shardings(config, mesh)

    def local(params, tokens, attn_mask, logit_floor, routes):
        return transformer.sequence_scores(params, config, tokens, contract=contract,
                                           mask=attn_mask, temperature=temperature,
                                           logit_floor=logit_floor,
                                           routes=routes if replay else None,
                                           expert_axis=EXPERT_AXIS)

    def score(params, tokens, attn_mask, logit_floor, routes=None):
        num_homes = mesh.devices.size
        if tokens.shape[0] % num_homes:
            raise ValueError(f"expert-parallel scores: {tokens.shape[0]} rows do not split over "
                             f"data * expert = {num_homes} devices")
        params = jax.lax.with_sharding_constraint(params, shardings)
        sharded = jax.shard_map(local, mesh=mesh,
                                in_specs=(specs, rows, rows, rows,
                                          None if routes is None else rows),
                                out_specs=rows, check_vma=False)
        return sharded(params, tokens, attn_mask, logit_floor, routes)

    return score
