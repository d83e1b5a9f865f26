"""GRPO grouping: B prompts become B * G rows, each prompt's G samples in consecutive rows.

This is the layout jrl.losses expects (groups are consecutive runs of `group_size` rows).
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def _check_group_size(where: str, group_size: object) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(
            f"{where}: group_size={group_size!r} is not allowed; it must be an int >= 1."
        )


def repeat_for_groups(items: Sequence[T], group_size: int) -> list[T]:
    """[B] -> [B * G]: each item repeated G times in a row ([a, b], 2 -> [a, a, b, b])."""
    _check_group_size("repeat_for_groups", group_size)
    return [item for item in items for _ in range(group_size)]


def group_ids(num_prompts: int, group_size: int) -> np.ndarray:
    """[num_prompts * G] int32: the group (prompt) index of each row ((2, 3) -> [0 0 0 1 1 1])."""
    _check_group_size("group_ids", group_size)
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 0:
        raise ValueError(
            f"group_ids: num_prompts={num_prompts!r} is not allowed; it must be an int >= 0."
        )
    return np.repeat(np.arange(num_prompts, dtype=np.int32), group_size)
