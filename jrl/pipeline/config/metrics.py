"""The metrics section of a run config: where a run's metrics go (jrl.metrics.writers)."""

from __future__ import annotations

import dataclasses

from jrl.checks import check_choice, did_you_mean
from jrl.metrics.writers import WANDB_MODES

# jsonl: <workdir>/metrics.jsonl; tensorboard: <workdir>/tensorboard (tensorboardX, a local
# workdir); wandb: a Weights & Biases run (the [wandb] extra).
METRIC_BACKENDS = ("jsonl", "tensorboard", "wandb")
WANDB_RUN_MODES = tuple(mode for mode in WANDB_MODES if mode != "false")


@dataclasses.dataclass(frozen=True)
class MetricsSection:
    """Where a run's metrics go.

    backends: None (the default): metrics.jsonl, plus TensorBoard under <workdir>/tensorboard
    where tensorboardX is installed and the workdir is local. A list of METRIC_BACKENDS
    (`--set metrics.backends=[jsonl,tensorboard,wandb]`): exactly those, each required (a
    missing package or a URL workdir for tensorboard is an error). jsonl is always listed:
    summary.json, `jrl plot` and resume read metrics.jsonl.
    wandb_mode (with wandb listed): "online" syncs as the run goes, "offline" writes under
    <workdir>/wandb for `wandb sync` later; the project is $WANDB_PROJECT, default "jrl".
    """

    backends: tuple[str, ...] | None = None
    wandb_mode: str = "online"

    def __post_init__(self):
        check_choice("metrics.wandb_mode", self.wandb_mode, WANDB_RUN_MODES)
        if self.backends is None:
            if self.wandb_mode != "online":
                raise ValueError(f"metrics.wandb_mode={self.wandb_mode!r} is not used: "
                                 "metrics.backends does not list wandb")
            return
        if isinstance(self.backends, (list, str)):
            backends = (self.backends,) if isinstance(self.backends, str) else self.backends
            object.__setattr__(self, "backends", tuple(backends))
        for name in self.backends:
            if name not in METRIC_BACKENDS:
                raise ValueError(f"metrics.backends: unknown backend {name!r}; allowed: "
                                 f"{list(METRIC_BACKENDS)}{did_you_mean(name, METRIC_BACKENDS)}")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"metrics.backends={list(self.backends)}: names a backend twice")
        if "jsonl" not in self.backends:
            raise ValueError(f"metrics.backends={list(self.backends)}: must list 'jsonl' "
                             "(summary.json, jrl plot and resume read metrics.jsonl)")
        if self.wandb_mode != "online" and "wandb" not in self.backends:
            raise ValueError(f"metrics.wandb_mode={self.wandb_mode!r} is not used: "
                             f"metrics.backends={list(self.backends)} does not list wandb")

    @property
    def tensorboard(self) -> str | bool:
        """jrl.metrics.writers.make_writers' tensorboard argument: "auto" (backends None),
        else whether tensorboard is listed."""
        return "auto" if self.backends is None else "tensorboard" in self.backends

    @property
    def wandb(self) -> str:
        """make_writers' wandb argument: wandb_mode where wandb is listed, else "false"."""
        return self.wandb_mode if "wandb" in (self.backends or ()) else "false"
