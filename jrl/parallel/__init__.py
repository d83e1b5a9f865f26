"""jrl.parallel: meshes, sharding rules applied to the train state, multi-host initialisation.
(The bitwise row-parallel train step built on them is jrl.train.parallel_step.)

    MeshConfig(data=1, fsdp=-1, tensor=1); make_mesh(mesh_config, devices=None) -> Mesh
    split_devices(devices, rollout, train=-1) -> (rollout_devices, train_devices)
    train_state_shardings(state_shape, model_config, mesh, rules=None) -> TrainState of shardings
    batch_sharding(mesh); shard_train_step(train_step, state_shardings, batch_sharding)
    host_to_global / local_rows_to_global / global_to_host: placing host data on a
      (multi-process) mesh and reading it back
    initialize(...); is_main_process(); process_index(); process_count()
    finish(status): how this process ends, for the others' watchdogs (watchdog.PeerWatchdog)
"""

from jrl.parallel.distributed import (
    CoordinatorUnreachable,
    DistributedInfo,
    finish,
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

__all__ = [
    "BATCH_AXES", "CoordinatorUnreachable", "DistributedInfo", "MeshConfig", "batch_sharding",
    "finish",
    "global_to_host", "host_to_global", "initialize", "is_main_process", "local_rows_to_global",
    "make_mesh", "mirror_params",
    "param_shardings", "process_count", "process_index", "replicated", "shard_train_step",
    "split_devices", "train_state_shardings",
]
