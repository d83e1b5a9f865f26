"""The run directory: jrl only ever replaces, deletes or writes into what it can prove is its own.

    claim = claim_workdir(workdir, resume=False, overwrite=None, name="...")  # at a run's start
    claim.release()                                                          # when it ends

What makes a directory a run: the marker file `jrl-run.json` (JRL_MARKER), written when a run
starts. Nothing else counts, however jrl-like a directory looks.

The rules, in order:
- `workdir` exists and is not a directory, or cannot be written: refused (WorkdirError naming
  the cause).
- another process holds the workdir's lock (`.jrl-lock`, an exclusive flock held for the run's
  life and released by the kernel when the process ends, even on SIGKILL): refused, naming the
  holder's pid, host and start time.
- missing or empty: a fresh run starts there.
- holds a run (the marker):
  - resume: the run continues from its latest checkpoint; an attempt that stopped before its
    first checkpoint is moved aside as with overwrite="move" and the run starts fresh (a
    scheduler that requeues a preempted job with --resume must not fail);
  - no flag: refused;
  - overwrite="move": the whole directory is renamed to `<workdir>.replaced-<UTC time>`;
  - overwrite="delete": jrl's own entries (JRL_ENTRIES) are deleted; anything else in the
    directory is kept and named in the log.
- holds no run but other files:
  - resume with checkpoints written by a jrl version before the marker existed
    (`checkpoints/<step>/`): continued (the restore checks the checkpoint), and marked;
  - overwrite: refused (there is no run to replace), naming what the directory holds;
  - a fresh run: allowed next to files that are not jrl's (a log file, notes), refused when
    any of them has a name jrl writes (JRL_ENTRIES), naming it.

A gs:// workdir (jrl.paths: a URL is kept as it is, never made absolute) follows the same rules
through etils.epath, except the lock: an object store has no flock and no lock that a killed
process releases, so two runs on one gs:// workdir at once are not prevented, and the claim says
so once in the log. The marker is one object write (atomic there); overwrite="move" copies
every object to `<workdir>.replaced-<UTC time>` and deletes the originals (not atomic, and as
long as the run is big: overwrite="delete" deletes in place).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time

from jrl import paths
from jrl.metrics.writers import check_tensorboard_target

OVERWRITE_MODES = ("move", "delete")
JRL_MARKER = "jrl-run.json"
LOCK_FILENAME = ".jrl-lock"
# Everything a run writes in its directory. overwrite="delete" deletes these and nothing else.
JRL_ENTRIES = (JRL_MARKER, "checkpoints", "metrics.jsonl", "config.json", "plots", "tensorboard")


class WorkdirError(ValueError):
    """A workdir that the requested run must not use as it is (the message says what to pass)."""


def check_run_paths(config, workdir: str) -> None:
    """ValueError naming the key when a URL among a run's paths cannot be used here: a workdir
    that is not gs://, a data.path / data.eval_path scheme jrl does not read, a filesystem
    package that is not installed (jrl.paths), or tensorboard in metrics.backends with a URL
    workdir. Run calls it first, `jrl train` before it starts JAX."""
    paths.check_url("--workdir", workdir, paths.WORKDIR_SCHEMES)
    paths.check_checkpoint_listing("--workdir", workdir)
    for key in ("path", "eval_path"):
        paths.check_url(f"data.{key}", getattr(config.data, key))
    check_tensorboard_target(workdir, config.metrics.tensorboard)


def _listing(names: list[str], most: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:most]) + (f", ... ({len(names)} entries)" if len(names) > most else "")


def _has_checkpoint(workdir: str) -> bool:
    directory = os.path.join(workdir, "checkpoints")
    return paths.isdir(directory) and any(name.isdigit() for name in paths.listdir(directory))


def is_run(workdir: str) -> bool:
    """True when `workdir` carries jrl's run marker."""
    return paths.isfile(os.path.join(workdir, JRL_MARKER))


def unlocked_note(workdir: str) -> str:
    """The log line of a claim on an object store (see the module docstring)."""
    return (f"note: {workdir} is on an object store, where jrl cannot lock it: two runs on it "
            "at once are not prevented (start one run per workdir); the run marker and the "
            "rules for existing runs still apply")


class WorkdirClaim:
    """A claimed workdir: its lock is held until release() (or the process ends). `moved` is
    where an old run was moved (or None); `kept` lists the entries overwrite="delete" left."""

    def __init__(self, workdir: str, lock_fd: int | None, moved: str | None, kept: list[str],
                 *, active: bool = True):
        self.workdir = workdir
        self.moved = moved
        self.kept = kept
        self._lock_fd = lock_fd
        self._active = active        # False: a process that only checks (act=False)

    @property
    def held(self) -> bool:
        return self._lock_fd is not None

    def acquire(self) -> None:
        """Takes the lock again after release() (a Run between two run() calls); raises
        WorkdirError naming the holder if another process took the workdir meanwhile. An object
        store's workdir has no lock (the module docstring)."""
        if self._active and self._lock_fd is None and not paths.is_url(self.workdir):
            self._lock_fd = _try_lock(self.workdir)
            _write_holder(self._lock_fd)

    def release(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __del__(self):
        self.release()


def _io_error(workdir: str, action: str, error: OSError) -> WorkdirError:
    cause = os.strerror(error.errno) if error.errno else str(error)
    return WorkdirError(f"--workdir {workdir!r}: cannot {action}: {cause}")


def _try_lock(workdir: str) -> int | None:
    """Opens and exclusively locks workdir/.jrl-lock; returns the fd (None on an object store,
    which has no lock). Raises WorkdirError naming the holder when another process has it."""
    if paths.is_url(workdir):
        return None
    path = os.path.join(workdir, LOCK_FILENAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise _io_error(workdir, "create its lock file", error) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise WorkdirError(f"--workdir {workdir!r} is in use by another jrl run ({holder}); "
                               "wait for it to end or choose another --workdir") from None
        raise _io_error(workdir, "lock it", error) from None
    return fd


def _write_holder(fd: int | None) -> None:
    if fd is None:
        return
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    text = f"pid {os.getpid()} on {socket.gethostname()} since {started}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def write_marker(workdir: str, *, name: str) -> None:
    """Writes the run marker atomically (a temporary file renamed into place)."""
    record = {"format": "jrl-run", "version": 1, "name": name,
              "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join(sys.argv)}
    path = os.path.join(workdir, JRL_MARKER)
    if paths.is_url(workdir):
        try:
            paths.write_text_atomic(path, json.dumps(record, indent=1))
        except OSError as error:
            raise _io_error(workdir, "write its run marker", error) from None
        return
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except OSError as error:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise _io_error(workdir, "write its run marker", error) from None


def _check_usable(workdir: str) -> None:
    if paths.exists(workdir) and not paths.isdir(workdir):
        raise WorkdirError(f"--workdir {workdir!r} is a file, not a directory; choose a "
                           "directory path")
    if paths.is_url(workdir):
        return              # an object store's permissions show on the first write
    if os.path.isdir(workdir) and not os.access(workdir, os.W_OK | os.X_OK):
        raise WorkdirError(f"--workdir {workdir!r}: cannot write into it: permission denied")


def _decide(workdir: str, *, resume: bool, overwrite: str | None) -> str:
    """What to do with an existing, locked workdir: "use", "move" or "delete". Raises
    WorkdirError for the refusals (see the module docstring)."""
    entries = [e for e in paths.listdir(workdir) if e != LOCK_FILENAME]
    if not [e for e in entries if e != JRL_MARKER]:
        return "use"        # empty, or a run that stopped before writing anything
    if is_run(workdir):
        if resume:
            if _has_checkpoint(workdir) or not paths.exists(os.path.join(workdir,
                                                                             "metrics.jsonl")):
                return "use"
            return "move"
        if overwrite is None:
            raise WorkdirError(
                f"{workdir} already holds a run ({_listing(entries)}); pass --resume to continue "
                "it, --overwrite to start over (the old run is moved to "
                f"{os.path.basename(workdir.rstrip(os.sep))}.replaced-<time>; --overwrite delete "
                "deletes jrl's files of it and keeps any others), or choose another --workdir")
        return overwrite
    if resume and _has_checkpoint(workdir):
        return "use"        # a run from before the marker existed: the restore checks it
    if overwrite is not None:
        raise WorkdirError(f"--overwrite: {workdir} holds no jrl run to replace (it holds "
                           f"{_listing(entries)}; a run carries {JRL_MARKER}); jrl replaces "
                           "only its own runs: choose another --workdir")
    colliding = [e for e in entries if e in JRL_ENTRIES]
    if colliding:
        raise WorkdirError(f"{workdir} holds no jrl run but has entries with the names a run "
                           f"writes ({_listing(colliding)}); choose another --workdir")
    return "use"


def claim_workdir(workdir: str, *, resume: bool = False, overwrite: str | None = None,
                  name: str = "run", act: bool = True,
                  log=lambda message: None) -> WorkdirClaim:
    """Applies the rules above and claims the workdir (lock held, marker written). `act=False`
    only checks (processes other than the one that writes files) and holds nothing. Raises
    WorkdirError."""
    if overwrite is not None and overwrite not in OVERWRITE_MODES:
        raise WorkdirError(f"overwrite={overwrite!r}: allowed are {OVERWRITE_MODES} or None")
    if resume and overwrite is not None:
        raise WorkdirError("--resume and --overwrite contradict each other: continue the run in "
                           f"{workdir} or start it over, not both")
    workdir = paths.resolve(workdir)     # a URL is kept as it is (jrl.paths)
    _check_usable(workdir)
    if not paths.isdir(workdir):
        if not act:
            return WorkdirClaim(workdir, None, None, [], active=False)
        try:
            paths.makedirs(workdir)
        except FileExistsError:
            pass                 # another run created it meanwhile: the lock decides below
        except OSError as error:
            raise _io_error(workdir, "create it", error) from None
    if not act:
        _decide(workdir, resume=resume, overwrite=overwrite)
        return WorkdirClaim(workdir, None, None, [], active=False)
    fd = _try_lock(workdir)
    moved, kept = None, []
    try:
        action = _decide(workdir, resume=resume, overwrite=overwrite)
        if action == "move":
            # Still holding the old directory's lock, so no other run can take it meanwhile.
            moved = _move_aside(workdir)
            if fd is not None:
                os.close(fd)
            fd = None
            paths.makedirs(workdir)
            fd = _try_lock(workdir)
            log(f"the run that was in {workdir} is now in {moved}")
        elif action == "delete":
            for entry in JRL_ENTRIES:
                _delete_entry(os.path.join(workdir, entry))
            kept = sorted(e for e in paths.listdir(workdir) if e != LOCK_FILENAME)
            log(f"deleted the run in {workdir}" + (f"; kept what jrl did not write: "
                                                   f"{_listing(kept)}" if kept else ""))
        else:
            others = [e for e in paths.listdir(workdir) if e != LOCK_FILENAME
                      and e not in JRL_ENTRIES]
            if others and not is_run(workdir):
                log(f"note: {workdir} also holds {_listing(others)} (not jrl's; left as it is)")
        _write_holder(fd)
        if not is_run(workdir):
            write_marker(workdir, name=name)
    except OSError as error:
        if fd is not None:
            os.close(fd)
        raise _io_error(workdir, "prepare it", error) from None
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    if paths.is_url(workdir):
        log(unlocked_note(workdir))
    return WorkdirClaim(workdir, fd, moved, kept)


def check_workdir(workdir: str, *, resume: bool = False, overwrite: str | None = None,
                  act: bool = True) -> str | None:
    """claim_workdir, releasing the lock at once; returns where an old run was moved (or None).
    For callers that only prepare a directory (tests, tools)."""
    claim = claim_workdir(workdir, resume=resume, overwrite=overwrite, act=act)
    claim.release()
    return claim.moved


def _delete_entry(path: str) -> None:
    """Deletes a file or a directory tree (a symlink itself, never what it points to)."""
    if paths.is_url(path):
        if paths.isdir(path):
            paths.rmtree(path)
        elif paths.exists(path):
            paths.remove(path)
    elif os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _move_aside(workdir: str) -> str:
    """Renames workdir to `<workdir>.replaced-<UTC time>` (suffixed if taken); returns that."""
    target = f"{workdir.rstrip(os.sep)}.replaced-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    base, suffix = target, 1
    while paths.exists(target):
        target = f"{base}~{suffix}"
        suffix += 1
    paths.rename(workdir, target)
    return target
