"""The run directory: a new run never replaces an old one without being told to.

    check_workdir(workdir, resume=False, overwrite=None)

- empty or missing: a fresh run starts there (with or without resume);
- holds a run and resume: the run continues from its latest checkpoint; an attempt that stopped
  before its first checkpoint (metrics, no checkpoint) cannot be continued, so it is moved aside
  as with overwrite="move" and the run starts fresh (a scheduler that requeues a preempted job
  with --resume must not fail on the one that never reached a checkpoint);
- holds a run and no resume: refused, unless overwrite="move" (the old run is renamed to
  `<workdir>.replaced-<UTC time>`) or overwrite="delete" (it is deleted).
"""

from __future__ import annotations

import os
import shutil
import time

OVERWRITE_MODES = ("move", "delete")


class WorkdirError(ValueError):
    """A workdir that the requested run must not use as it is (the message says what to pass)."""


def _has_checkpoint(workdir: str) -> bool:
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def check_workdir(workdir: str, *, resume: bool = False, overwrite: str | None = None,
                  act: bool = True) -> str | None:
    """Applies the rules above. Returns where an old run was moved (or None). `act=False` only
    checks (processes other than the one that writes files). Raises WorkdirError."""
    if overwrite is not None and overwrite not in OVERWRITE_MODES:
        raise WorkdirError(f"overwrite={overwrite!r}: allowed are {OVERWRITE_MODES} or None")
    if resume and overwrite is not None:
        raise WorkdirError("--resume and --overwrite contradict each other: continue the run in "
                           f"{workdir} or start it over, not both")
    if not os.path.isdir(workdir) or not os.listdir(workdir):
        return None
    if resume:
        if _has_checkpoint(workdir) or not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
            return None
        return _move_aside(workdir) if act else None
    if overwrite is None:
        found = sorted(os.listdir(workdir))
        raise WorkdirError(f"{workdir} already holds a run ({', '.join(found[:5])}"
                           f"{', ...' if len(found) > 5 else ''}); pass --resume to continue it, "
                           "--overwrite to start over (the old run is moved to "
                           f"{os.path.basename(workdir)}.replaced-<time>; --overwrite delete "
                           "deletes it), or choose another --workdir")
    if not act:
        return None
    if overwrite == "delete":
        shutil.rmtree(workdir)
        return None
    return _move_aside(workdir)


def _move_aside(workdir: str) -> str:
    """Renames workdir to `<workdir>.replaced-<UTC time>` (suffixed if taken); returns that."""
    target = f"{workdir.rstrip(os.sep)}.replaced-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    suffix = 1
    while os.path.exists(target):
        target = f"{target.split('~')[0]}~{suffix}"
        suffix += 1
    os.rename(workdir, target)
    return target
