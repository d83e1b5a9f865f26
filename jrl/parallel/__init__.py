"""jrl.parallel: meshes, sharding rules applied to the train state, the bitwise row-parallel
train step, multi-host initialisation.

    MeshConfig(data=1, fsdp=-1, tensor=1); make_mesh(mesh_config, devices=None) -> Mesh
    split_devices(devices, rollout, train=-1) -> (rollout_devices, train_devices)
    train_state_shardings(state_shape, model_config, mesh, rules=None) -> TrainState of shardings
    batch_sharding(mesh); shard_train_step(train_step, state_shardings, batch_sharding)
    make_parallel_train_step(config, contract, loss_fn, optimizer, mesh, num_micro_batches=None)
    make_parallel_logprob_fn(config, contract, mesh) -> row-parallel p_o, bitwise = one device
    host_to_global / local_rows_to_global / global_to_host: placing host data on a
      (multi-process) mesh and reading it back
    initialize(...); is_main_process(); process_index(); process_count()
"""

from jrl.parallel.distributed import (
    CoordinatorUnreachable,
    DistributedInfo,
    initialize,
    is_main_process,
    process_count,
    process_index,
)
from jrl.parallel.mesh import MeshConfig, make_mesh, split_devices
from jrl.parallel.rules import (
    BATCH_AXES,
    batch_sharding,
    global_to_host,
    host_to_global,
    local_rows_to_global,
    mirror_params,
    param_shardings,
    replicated,
    shard_train_step,
    train_state_shardings,
)
from jrl.parallel.step import (make_parallel_logprob_fn, make_parallel_train_step,
                               ordered_shard_sum)

__all__ = [
    "BATCH_AXES", "CoordinatorUnreachable", "DistributedInfo", "MeshConfig", "batch_sharding",
    "global_to_host", "host_to_global", "initialize", "is_main_process", "local_rows_to_global",
    "make_mesh", "make_parallel_logprob_fn", "make_parallel_train_step", "mirror_params",
    "ordered_shard_sum",
    "param_shardings", "process_count", "process_index", "replicated", "shard_train_step",
    "split_devices", "train_state_shardings",
]
