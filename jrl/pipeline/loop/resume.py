"""A run's checkpoints: saving a step, and resuming from the newest intact one or a chosen one.

    save_checkpoint(trainer, config, rl_step, data_state, log=print)
    meta = restore_checkpoint(trainer, config, model_config, resume_step=None, log=print)
    start_step = resume_from_checkpoint(trainer, stream, config)     # the RL step, or None

- a save that an interrupt (Ctrl-C, SIGTERM) arrives in completes first, then the interrupt is
  raised (jrl.pipeline.loop.faults.interrupts_deferred);
- a step whose files cannot be read (truncated arrays, broken metadata) is set aside as
  `<step>.corrupt-<n>` with a warning naming the problem, and the next older one is tried;
- a checkpoint whose model or numerical contract differs from the run's is refused (ValueError
  naming each differing field); other changed config fields are logged (seeds and the
  schedule's length by the values they take: RunConfig.resolved);
- resuming from an older step than the newest (resume_step) sets the newer steps aside as
  `<step>.superseded-<n>`: the run will write those step numbers again, and nothing is deleted.
"""

from __future__ import annotations

from typing import Callable

from jrl import logs
from jrl.data import PromptStream
from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from jrl.pipeline.config import RunConfig, config_from_dict
from jrl.pipeline.config.tools import to_dict
from jrl.pipeline.loop.faults import interrupts_deferred
from jrl.pipeline.training.trainer import Trainer
from jrl.train.checkpoint import CorruptCheckpointError


def save_checkpoint(trainer: Trainer, config: RunConfig, rl_step: int, data_state: dict, *,
                    log: Callable[[str], None] = logs.info) -> None:
    """Writes checkpoint rl_step: the train state, the reference, and metadata (rl_step,
    version, data_state, config, numerics, model) that resuming checks. An interrupt that
    arrives meanwhile is raised once the checkpoint is complete on disk."""
    meta = {"rl_step": rl_step, "version": trainer.version, "data_state": data_state,
            "config": to_dict(config), "numerics": trainer.contract.to_dict(),
            "model": trainer.model_config.to_dict()}
    with interrupts_deferred():
        trainer.save(rl_step, meta)
        log(f"checkpoint: step {rl_step} -> {trainer.checkpointer.directory}")


def resume_from_checkpoint(trainer: Trainer, stream: PromptStream, config: RunConfig, *,
           resume_step: int | None = None, set_aside: bool = True,
           log: Callable[[str], None] = logs.info) -> int | None:
    """Restores the newest intact checkpoint (or resume_step) into `trainer` and the prompt
    stream's position into `stream`; returns the RL step it holds, or None when there is no
    checkpoint yet (then nothing changes)."""
    meta = restore_checkpoint(trainer, config, trainer.model_config, resume_step=resume_step,
                              set_aside=set_aside, log=log)
    if meta is None:
        log("resume: no checkpoint yet, starting fresh")
        return None
    stream.load_state_dict(meta["data_state"])
    step = int(meta["rl_step"])
    log(f"resume: from step {step} (version {trainer.version})")
    return step


def dict_diffs(old: dict, new: dict, prefix: str = "") -> list[str]:
    """["a.b: 1 -> 2", ...] for the leaves of two nested dicts that differ."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += dict_diffs(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


def _resolved_dict(saved: dict, log: Callable[[str], None]) -> dict:
    """A checkpoint's config with its derived values written out (RunConfig.resolved), so that
    a seed or schedule length left to follow the run compares by the value it took, and keys
    that have moved read under their new names (one log line each); the dict as saved where
    it no longer builds a RunConfig."""
    try:
        return to_dict(config_from_dict(
            saved, log=lambda note: log(f"resume: the checkpoint's {note}")).resolved())
    except (ValueError, TypeError):
        return saved


def restore_checkpoint(trainer: Trainer, config: RunConfig, model_config: ModelConfig, *,
                       resume_step: int | None = None, set_aside: bool = True,
                       log: Callable[[str], None] = logs.info) -> dict | None:
    """Restores into `trainer` the newest intact checkpoint (or `resume_step`) and returns its
    metadata; None when the directory holds no checkpoint. set_aside=False (processes that do
    not write files) leaves unreadable steps in place."""
    checkpointer = trainer.checkpointer
    steps = sorted(checkpointer.all_steps(), reverse=True)
    if not steps:
        return None
    newer: list[int] = []
    if resume_step is not None:
        if resume_step not in steps:
            raise ValueError(f"--resume-step {resume_step}: no such checkpoint in "
                             f"{checkpointer.directory}; available: {sorted(steps)}")
        newer = sorted(step for step in steps if step > resume_step)
        steps = [resume_step]
    for step in steps:
        try:
            meta = _restore_step(trainer, config, model_config, step, log)
            if newer and set_aside:
                moved = [checkpointer.set_aside(s, "superseded") for s in newer]
                log(f"resume: from step {step}; the newer checkpoints {newer} are set aside as "
                    f"{', '.join(moved)} (this run writes those steps again)")
            return meta
        except CorruptCheckpointError as err:
            if resume_step is not None:
                raise ValueError(f"--resume-step {step}: {err}") from err
            moved = checkpointer.set_aside(step) if set_aside else "(kept)"
            log(f"warning: resume: checkpoint step {step} is unreadable: {err}; set aside as "
                f"{moved}; trying the previous one")
    raise ValueError(f"resume: no intact checkpoint in {checkpointer.directory} (every step was "
                     "unreadable and set aside); start over with --overwrite")


def _restore_step(trainer: Trainer, config: RunConfig, model_config: ModelConfig,
                  step: int, log: Callable[[str], None]) -> dict:
    checkpointer = trainer.checkpointer
    meta = checkpointer.read_meta(step)
    where = f"resume from {checkpointer.directory} (step {step})"
    NumericalContract.from_dict(meta["numerics"]).check_compatible(
        config.numerics, what=f"checkpoint ({where})")
    model_diffs = dict_diffs(meta["model"], model_config.to_dict())
    if model_diffs:
        raise ValueError(f"{where}: the model differs from the checkpoint's: "
                         + "; ".join(model_diffs))
    saved = _resolved_dict(meta["config"], log)
    config_diffs = dict_diffs(saved, to_dict(config.resolved()))
    if config_diffs:
        log(f"resume: the config differs from the checkpoint's in {'; '.join(config_diffs)}; "
            "going on with this run's values")
    # train.reference as the checkpoint's run resolved it ("auto" follows its recipe).
    return trainer.restore(with_reference=saved["train"]["reference"] != "none", step=step)
