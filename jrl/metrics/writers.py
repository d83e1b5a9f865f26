"""Metric writers: jsonl (always), TensorBoard (if a backend is installed), Weights & Biases (if
asked for), one fan-out for all. A run picks them with its metrics section
(jrl.pipeline.config.metrics: metrics.backends, metrics.wandb_mode).

Only process 0 of a multi-host run writes; `make_writers` gives the others a writer that does
nothing, so call sites need no `if process_index == 0`.

A gs:// workdir (jrl.paths): metrics.jsonl is one object rewritten whole, since an object store
cannot append (JsonlWriter); TensorBoard writes to local workdirs only; Weights & Biases keeps
its local files in the temporary directory.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import secrets
import tempfile
import time
import warnings
from typing import Any, Iterable, Mapping, Protocol

from jrl import paths

# Key of the jsonl field that records which values were NaN or +-inf (they are written as null).
NONFINITE_KEY = "nonfinite"
TENSORBOARD_CHOICES = ("auto", True, False)


class MetricWriter(Protocol):
    """Anything that records one step's scalars."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _check_step(where: str, step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"{where}: step={step!r} is not allowed; it must be an int >= 0.")
    return int(step)


def to_python_scalar(name: str, value: Any) -> bool | int | float | str | None:
    """A metric value as a plain Python scalar: numpy / jax 0-d arrays and size-1 arrays unwrapped.

    bool, int, float, str and None pass through. Anything with more than one element, or of
    another type, raises ValueError naming the metric (a silently averaged array would mislead).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    # numpy and jax arrays (and numpy scalars) expose shape/size/item; checked by duck typing so
    # this module never imports jax.
    size = getattr(value, "size", None)
    if size is not None and hasattr(value, "item"):
        if size != 1:
            raise ValueError(
                f"metric {name!r} has shape {getattr(value, 'shape', '?')}; "
                "metric values must be scalars "
                "(reduce the array before logging)."
            )
        return to_python_scalar(name, value.item())
    raise ValueError(
        f"metric {name!r} has value {value!r} of type {type(value).__name__}; "
        "allowed: int, float, bool, str, None, or a one-element numpy/jax array."
    )


def encode_record(step: int, metrics: Mapping[str, Any]) -> str:
    """One jsonl line (no newline): {"step": step, **metrics}; NaN/inf as null + a "nonfinite" map.

    JSON has no NaN or Infinity, so such a value is written as null and its text ("nan", "inf",
    "-inf") is kept under "nonfinite": {name: "inf"}; `decode_record` restores it.
    Every line is strict JSON, which parsers in any language accept.
    """
    record: dict[str, Any] = {"step": _check_step("encode_record", step)}
    nonfinite: dict[str, str] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or name in ("step", NONFINITE_KEY):
            raise ValueError(
                f"metric name {name!r} is not allowed; names are strings other than 'step' "
                f"and {NONFINITE_KEY!r}."
            )
        scalar = to_python_scalar(name, value)
        if isinstance(scalar, float) and not math.isfinite(scalar):
            nonfinite[name] = repr(scalar)  # "nan", "inf", "-inf"
            scalar = None
        record[name] = scalar
    if nonfinite:
        record[NONFINITE_KEY] = nonfinite
    return json.dumps(record, allow_nan=False, separators=(",", ":"))


def decode_record(line: str) -> dict[str, Any]:
    """Inverse of `encode_record`: NaN/inf values restored, the "nonfinite" map removed."""
    record = json.loads(line)
    if not isinstance(record, dict) or "step" not in record:
        raise ValueError("not a metrics record (a JSON object with a 'step' field)")
    for name, text in record.pop(NONFINITE_KEY, {}).items():
        record[name] = float(text)
    return record


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file, in file order (see `encode_record` for the format).

    A last line without its newline (a crash mid-write) is skipped with a warning; any other
    malformed line raises ValueError naming the file and line number.
    """
    path = os.fspath(path)
    if not paths.isfile(path):
        raise FileNotFoundError(f"read_metrics: no such file: {path!r}")
    with paths.open_file(path, encoding="utf-8") as file:
        lines = file.read().split("\n")
    # After split, the last element is "" when the file ends with a newline, else a partial line.
    complete, partial = lines[:-1], lines[-1]
    records = _decode_lines(path, complete)
    if partial.strip():
        warnings.warn(
            f"{path}: ignoring an unterminated last line ({len(partial)} characters, likely a "
            "crash mid-write).",
            stacklevel=2,
        )
    return records


def _decode_lines(path: str, lines: list[str]) -> list[dict[str, Any]]:
    """The records of complete lines (blank ones skipped); ValueError naming path:line."""
    records = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(decode_record(line))
        except ValueError as error:
            raise ValueError(f"{path}:{line_number}: malformed metrics record ({error})") from None
    return records


# A URL's metrics.jsonl is rewritten whole at most this often while steps are written, and at
# each flush() and close() (Run flushes before each checkpoint, so that a resume finds every
# record up to its step).
REMOTE_UPLOAD_S = 30.0


class JsonlWriter:
    """Appends one JSON object per step to a file: {"step": int, "<metric name>": value, ...}.

    Each write is flushed, so a crash loses at most the line being written. Reopening an existing
    file appends to it (a resumed run continues the same file). Steps must not go backwards:
    writing a step below the file's last step raises, because it would leave two histories in
    one file; on resume call `truncate_after(resume_step)` first. Several records may share a
    step (e.g. train metrics and eval metrics logged separately).

    A URL (gs://...; jrl.paths): an object store cannot append, so the writer keeps the file's
    lines and rewrites the object whole, at most every REMOTE_UPLOAD_S seconds and at each
    flush() and close(); a crash loses the records since the last upload.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._remote = paths.is_url(self.path)
        if self._remote:
            self._open_remote()
            return
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._last_step = -1
        if os.path.exists(self.path):
            self._drop_partial_last_line()
            records = read_metrics(self.path)
            self._last_step = max((int(record["step"]) for record in records), default=-1)
        self._file = open(self.path, "a", encoding="utf-8")

    def _open_remote(self) -> None:
        text = ""
        if paths.exists(self.path):
            with paths.open_file(self.path) as file:
                text = file.read()
        if text and not text.endswith("\n"):
            keep = text.rfind("\n") + 1
            warnings.warn(
                f"{self.path}: removing an unterminated last line ({len(text) - keep} characters, "
                "likely a crash mid-write) before appending.",
                stacklevel=3,
            )
            text = text[:keep]
        self._lines = [line for line in text.split("\n") if line.strip()]
        records = _decode_lines(self.path, self._lines)
        self._last_step = max((int(record["step"]) for record in records), default=-1)
        self._uploaded_at: float | None = None
        self._dirty = False
        self._file = None

    def _upload(self) -> None:
        paths.write_text_atomic(self.path, "".join(line + "\n" for line in self._lines))
        self._uploaded_at, self._dirty = time.monotonic(), False

    @property
    def last_step(self) -> int | None:
        """The largest step in the file, or None if it is empty."""
        return None if self._last_step < 0 else self._last_step

    def _drop_partial_last_line(self) -> None:
        with open(self.path, "rb") as file:
            data = file.read()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            warnings.warn(
                f"{self.path}: removing an unterminated last line ({len(data) - keep} bytes, "
                "likely a crash mid-write) before appending.",
                stacklevel=3,
            )
            with open(self.path, "r+b") as file:
                file.truncate(keep)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        step = _check_step("JsonlWriter.write", step)
        if step < self._last_step:
            raise ValueError(
                f"JsonlWriter.write: step={step} is below the last step {self._last_step} "
                f"already in "
                f"{self.path}; on resume call truncate_after(resume_step) before writing."
            )
        line = encode_record(step, metrics)
        if self._remote:
            self._lines.append(line)
            self._dirty = True
            if self._uploaded_at is None or \
                    time.monotonic() - self._uploaded_at >= REMOTE_UPLOAD_S:
                self._upload()
        else:
            self._file.write(line + "\n")
            self._file.flush()
        self._last_step = step

    def truncate_after(self, step: int) -> int:
        """Removes records with step > `step` (file rewritten atomically); returns how many."""
        step = _check_step("JsonlWriter.truncate_after", step)
        if self._remote:
            kept = [line for line in self._lines if decode_record(line)["step"] <= step]
            removed, self._lines = len(self._lines) - len(kept), kept
            self._last_step = max((decode_record(line)["step"] for line in kept), default=-1)
            self._upload()
            return removed
        self._file.close()
        with open(self.path, encoding="utf-8") as file:
            lines = [line for line in file.read().split("\n") if line.strip()]
        kept = [line for line in lines if decode_record(line)["step"] <= step]
        temporary = self.path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as file:
            file.writelines(line + "\n" for line in kept)
        os.replace(temporary, self.path)
        self._last_step = max((decode_record(line)["step"] for line in kept), default=-1)
        self._file = open(self.path, "a", encoding="utf-8")
        return len(lines) - len(kept)

    def flush(self) -> None:
        if not self._remote:
            self._file.flush()
        elif self._dirty:
            self._upload()

    def close(self) -> None:
        if self._remote:
            self.flush()
        else:
            self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def tensorboard_available() -> str | None:
    """"tensorboardX" when that package (the one TensorBoard backend) is installed, else None."""
    import importlib.util

    return "tensorboardX" if importlib.util.find_spec("tensorboardX") is not None else None


WANDB_MODES = ("false", "online", "offline")
WANDB_ID_FILE = "wandb_run_id"


class WandbWriter:
    """Writes numeric metrics to a Weights & Biases run (strings and None are skipped).

    wandb is an optional extra (pip install 'jrl[wandb]'); ImportError naming it when missing.
    mode "online" syncs as it goes, "offline" writes under <workdir>/wandb for `wandb sync`
    later. The project is $WANDB_PROJECT or "jrl", the run's name `name`, its config `config`
    (the RunConfig as a dict). The run's W&B id is kept in <workdir>/wandb_run_id, so a resumed
    jrl run continues the same W&B run. A URL workdir (gs://...): W&B's own local files go to
    <temporary directory>/jrl-wandb instead, as W&B writes to local directories only.
    """

    def __init__(self, workdir: str | os.PathLike[str], *, mode: str, name: str,
                 config: Mapping[str, Any] | None = None) -> None:
        if mode not in ("online", "offline"):
            raise ValueError(f"WandbWriter: mode={mode!r}; allowed: 'online', 'offline'")
        try:
            import wandb
        except ImportError:
            raise ImportError("wandb in metrics.backends needs the wandb package, which is not "
                              "installed: pip install 'jrl[wandb]' (or pip install wandb), or "
                              "leave wandb out of metrics.backends") from None
        workdir = os.fspath(workdir)
        id_path = os.path.join(workdir, WANDB_ID_FILE)
        if paths.exists(id_path):
            with paths.open_file(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(4)      # W&B run ids: lowercase letters and digits
            with paths.open_file(id_path, "w") as f:
                f.write(run_id + "\n")
        local_dir = workdir
        if paths.is_url(workdir):
            local_dir = os.path.join(tempfile.gettempdir(), "jrl-wandb")
            os.makedirs(local_dir, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jrl"), name=name,
                              id=run_id, resume="allow", dir=local_dir, mode=mode,
                              config=dict(config or {}),
                              settings=wandb.Settings(silent=True, console="off"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        step = _check_step("WandbWriter.write", step)
        scalars = {}
        for name, value in metrics.items():
            scalar = to_python_scalar(name, value)
            if isinstance(scalar, (int, float)):  # bool is an int: logged as 0/1
                scalars[name] = float(scalar)
        self.run.log(scalars, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class TensorBoardWriter:
    """Writes numeric metrics as TensorBoard scalars under `logdir` (strings and None are skipped).

    The backend is tensorboardX (an optional extra: requirements-tensorboard.txt); raises
    ImportError naming it when it is not installed.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = os.fspath(logdir)
        self.backend = tensorboard_available()
        if self.backend is None:
            raise ImportError(
                "TensorBoardWriter needs tensorboardX, which is not installed. Install it "
                "(`pip install tensorboardX`, or -r requirements-tensorboard.txt) or leave "
                "tensorboard out of metrics.backends."
            )
        os.makedirs(self.logdir, exist_ok=True)
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(self.logdir)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        step = _check_step("TensorBoardWriter.write", step)
        for name, value in metrics.items():
            scalar = to_python_scalar(name, value)
            if isinstance(scalar, (int, float)):  # bool is an int: logged as 0/1
                self._writer.add_scalar(name, float(scalar), global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class NullWriter:
    """Accepts and discards everything (non-zero processes of a multi-host run)."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        del step, metrics

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MultiWriter:
    """Sends every call to each of `writers`, in order."""

    def __init__(self, writers: Iterable[MetricWriter]) -> None:
        self.writers = list(writers)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for writer in self.writers:
            writer.write(step, metrics)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()

    def __enter__(self) -> MultiWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"


def check_tensorboard_target(workdir: str | os.PathLike[str], tensorboard: str | bool) -> None:
    """ValueError when tensorboard=True asks for event files in a URL workdir (TensorBoard
    writes to a local workdir only; "auto" writes jsonl only there)."""
    workdir = os.fspath(workdir)
    if tensorboard is True and paths.is_url(workdir):
        raise ValueError(f"metrics.backends lists tensorboard: TensorBoard event files are "
                         f"written to a local workdir only, and {workdir!r} is a URL; leave "
                         "tensorboard out of metrics.backends (unset, it writes jsonl only "
                         "there)")


def make_writers(
    workdir: str | os.PathLike[str],
    *,
    tensorboard: str | bool = "auto",
    is_main_process: bool = True,
    resume_step: int | None = None,
    wandb: str = "false",
    run_name: str = "run",
    run_config: Mapping[str, Any] | None = None,
) -> MultiWriter:
    """The run's writers: <workdir>/metrics.jsonl, plus TensorBoard under <workdir>/tensorboard,
    plus Weights & Biases (wandb "online" or "offline": WandbWriter, named run_name, with
    run_config as its config).

    Args:
      tensorboard: True requires a TensorBoard backend (ImportError if none) and a local workdir
        (check_tensorboard_target); False never uses one; "auto" uses one if installed and the
        workdir is local, and otherwise writes jsonl only (jrl/cli/plot.py reads jsonl).
      is_main_process: False (processes other than 0) returns a MultiWriter of one NullWriter and
        touches no file.
      resume_step: when resuming from the checkpoint of this step, records after it (written by
        the interrupted run past its last checkpoint) are removed from metrics.jsonl.
    """
    if tensorboard not in TENSORBOARD_CHOICES or (
        tensorboard != "auto" and not isinstance(tensorboard, bool)
    ):
        raise ValueError(
            f"make_writers: tensorboard={tensorboard!r} is not allowed; "
            f"allowed: {TENSORBOARD_CHOICES}."
        )
    if not is_main_process:
        return MultiWriter([NullWriter()])
    check_tensorboard_target(workdir, tensorboard)
    jsonl = JsonlWriter(os.path.join(os.fspath(workdir), METRICS_FILENAME))
    if resume_step is not None:
        jsonl.truncate_after(resume_step)
    writers: list[MetricWriter] = [jsonl]
    if tensorboard is True or (tensorboard == "auto" and tensorboard_available() is not None
                               and not paths.is_url(os.fspath(workdir))):
        writers.append(TensorBoardWriter(os.path.join(os.fspath(workdir), TENSORBOARD_DIRNAME)))
    if wandb != "false":
        writers.append(WandbWriter(workdir, mode=wandb, name=run_name, config=run_config))
    return MultiWriter(writers)
