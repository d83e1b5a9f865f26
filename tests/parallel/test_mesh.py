"""make_mesh shapes and errors; split_devices."""

from __future__ import annotations

import pytest

from jrl.parallel import MeshConfig, make_mesh, split_devices

from .helpers import devices


def test_make_mesh_shapes():
    devs = devices(8)
    assert dict(make_mesh(MeshConfig(), devs).shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2), devs)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    # Devices in the given order, last axis fastest.
    assert [d.id for d in mesh.devices[1, 0]] == [devs[4].id, devs[5].id]
    assert dict(make_mesh(MeshConfig(data=-1, fsdp=1), devs[:4]).shape)["data"] == 4
    assert dict(make_mesh(MeshConfig(1, 1, 1), devs[:1]).shape) == {
        "data": 1, "fsdp": 1, "tensor": 1}


def test_make_mesh_errors_name_the_sizes():
    devs = devices(8)
    with pytest.raises(ValueError, match=r"data \* fsdp \* tensor = 6, but there are 8 devices"):
        make_mesh(MeshConfig(data=2, fsdp=3, tensor=1), devs)
    with pytest.raises(ValueError, match=r"fixed axes take 3 devices, which does not divide the "
                                         r"8 devices available, so fsdp=-1"):
        make_mesh(MeshConfig(data=3, fsdp=-1), devs)
    with pytest.raises(ValueError, match=r"at most one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match=r"MeshConfig.tensor=0: must be a positive int or -1"):
        MeshConfig(tensor=0)
    with pytest.raises(ValueError, match="duplicate devices"):
        make_mesh(MeshConfig(fsdp=2), [devs[0], devs[0]])


def test_split_devices():
    devs = devices(8)
    rollout, train = split_devices(devs, 3)
    assert rollout == devs[:3] and train == devs[3:]
    rollout, train = split_devices(devs, 4, 2)
    assert rollout == devs[:4] and train == devs[4:6]
    assert not set(d.id for d in rollout) & set(d.id for d in train)
    with pytest.raises(ValueError, match=r"6 rollout \+ 4 train devices requested but only 8 "
                                         r"available"):
        split_devices(devs, 6, 4)
    with pytest.raises(ValueError, match=r"8 rollout \+ at least 1 train devices requested"):
        split_devices(devs, 8)
    with pytest.raises(ValueError, match=r"rollout=0 must be a positive int"):
        split_devices(devs, 0)
