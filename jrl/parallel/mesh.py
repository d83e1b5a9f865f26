"""Device meshes: the named ("data", "fsdp", "tensor") mesh over every process's devices, and the
split of devices between the sampler (rollout) and the trainer for the async pipeline."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jrl.models.sharding import MESH_AXES


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the three mesh axes; at most one may be -1 = "all remaining devices".

    data: pure data parallelism (params replicated over it).
    fsdp: rows AND params/optimizer state split over it (params are all-gathered for compute).
    tensor: params sharded over heads / MLP / vocabulary (see jrl.models.sharding.DEFAULT_RULES).
    The default (1, -1, 1) puts every device on the fsdp axis.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool)
                    or (value <= 0 and value != -1)):
                raise ValueError(f"MeshConfig.{name}={value!r}: must be a positive int or -1 "
                                 "(fill with the remaining devices)")
        fills = [name for name in MESH_AXES if getattr(self, name) == -1]
        if len(fills) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {fills}")

    def shape(self, num_devices: int) -> dict[str, int]:
        """Axis sizes for `num_devices` devices (the -1 axis resolved); raises if they don't fit."""
        sizes = {name: getattr(self, name) for name in MESH_AXES}
        fixed = math.prod(size for size in sizes.values() if size != -1)
        fill = [name for name, size in sizes.items() if size == -1]
        if fill:
            if num_devices % fixed:
                raise ValueError(
                    f"MeshConfig{_fmt(sizes)}: the fixed axes take {fixed} devices, which does not "
                    f"divide the {num_devices} devices available, so {fill[0]}=-1 cannot be "
                    "filled")
            sizes[fill[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ValueError(
                f"MeshConfig{_fmt(sizes)}: data * fsdp * tensor = {fixed}, but there are "
                f"{num_devices} devices; make the product equal the device count or set one "
                "axis to -1")
        return sizes


def _fmt(sizes: dict) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in sizes.items()) + ")"


def make_mesh(mesh_config: MeshConfig | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes ("data", "fsdp", "tensor") over `devices` (default: jax.devices(), which
    after jrl.parallel.initialize spans every process).

    Devices are laid out topology-aware on TPU (mesh_utils.create_device_mesh); elsewhere in the
    given order, process-major. The arrangement never changes results: every cross-device
    reduction in jrl.parallel runs in mesh-index order, not physical order.
    """
    mesh_config = MeshConfig() if mesh_config is None else mesh_config
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: no devices given")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError(f"make_mesh: duplicate devices in {devices}")
    sizes = mesh_config.shape(len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    if devices[0].platform == "tpu":
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def split_devices(devices: Sequence[jax.Device] | None, rollout: int,
                  train: int = -1) -> tuple[list[jax.Device], list[jax.Device]]:
    """Disjoint (rollout_devices, train_devices) for the async pipeline: the first `rollout`
    devices sample, the next `train` (-1 = all the rest) train.

    Devices are taken in order (jax.devices() is process-major), so on a multi-host run a whole
    host's devices stay on one side when the counts are multiples of the per-host count.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("rollout", rollout), ("train", train)):
        if not isinstance(value, int) or isinstance(value, bool) or (value <= 0 and value != -1):
            raise ValueError(f"split_devices: {name}={value!r} must be a positive int"
                             + (" or -1 (the rest)" if name == "train" else ""))
    if rollout == -1:
        raise ValueError("split_devices: rollout=-1 is not allowed; give the rollout count and "
                         "let train=-1 take the rest")
    need = rollout + (1 if train == -1 else train)
    if need > len(devices):
        what = f"{rollout} rollout + {'at least 1' if train == -1 else train} train"
        raise ValueError(f"split_devices: {what} devices requested but only {len(devices)} "
                         "available; rollout and train device sets must be disjoint")
    end = len(devices) if train == -1 else rollout + train
    return devices[:rollout], devices[rollout:end]


def data_by_axis_mesh(axis: str, size: int, devices: Sequence[jax.Device] | None = None, *,
                      data: int = 1) -> Mesh:
    """A Mesh with axes ("data", axis) of shape (data, size) over the first data * size of
    `devices` (default jax.devices()), in order: expert and tensor parallelism's meshes."""
    devices = list(jax.devices() if devices is None else devices)
    for name, value in ((axis, size), ("data", data)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"a {axis}-parallel mesh: {name}={value!r} must be a positive int")
    if data * size > len(devices):
        raise ValueError(f"a {axis}-parallel mesh: data * {axis} = {data * size} devices, but "
                         f"only {len(devices)} are available")
    grid = np.array(devices[:data * size], dtype=object).reshape(data, size)
    return Mesh(grid, ("data", axis))
