"""Publishing the policy's weights to the rollout devices.

With LoRA the frozen base is copied to each rollout device once and stays resident there; every
later publish copies only the trainable params (the adapters) and joins them to the resident
base, so a weight sync moves kilobytes to megabytes instead of the whole model. Without
adapters every publish copies every param, as before.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from jrl.models.lora import merge_trainable, param_bytes, split_trainable


class WeightPublisher:
    """publisher(params, devices) -> one copy of params per device.

    The frozen part (jrl.models.lora.split_trainable) is re-sent only when it is a different
    set of arrays than the one resident on that device. last_bytes: the bytes the last call
    copied to all devices together.
    """

    def __init__(self):
        self._resident: dict[Any, tuple[list, Any]] = {}   # device -> (source leaves, copy)
        self.last_bytes = 0

    def __call__(self, params, devices: Sequence) -> list:
        trainable, frozen = split_trainable(params)
        copies, copied = [], 0
        for device in devices:
            moved = jax.device_put(trainable, device)
            copied += param_bytes(trainable)
            if frozen:
                leaves = jax.tree.leaves(frozen)
                held = self._resident.get(device)
                if held is None or len(held[0]) != len(leaves) or any(
                        a is not b for a, b in zip(held[0], leaves)):
                    held = (leaves, jax.device_put(frozen, device))
                    self._resident[device] = held
                    copied += param_bytes(frozen)
                moved = merge_trainable(moved, held[1])
            copies.append(moved)
        self.last_bytes = copied
        return copies
