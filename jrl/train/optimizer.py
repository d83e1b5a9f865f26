"""AdamW with global-norm clipping and a warmup + (constant | cosine | linear) schedule."""

from __future__ import annotations

import dataclasses

import optax

from jrl.checks import check_choice, check_int, check_range

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (b1, b2, eps, weight_decay) after global-norm clipping at max_grad_norm (None: no
    clipping), at a learning rate that rises linearly from 0 over warmup_steps updates and then
    follows `schedule`: "constant", or a "cosine" / "linear" decay to
    learning_rate * end_lr_fraction that ends at update total_steps.

    total_steps: the schedule's length in optimizer updates. None (the default) follows the run:
    a run config resolves it to train.steps x train.updates_per_step (mini_batches x epochs),
    every update of the run (RunConfig.resolved_optimizer), so a shorter or longer run decays
    over its own length; an explicit value is kept as it is. On its own (outside a run config)
    a schedule of None length is refused where it needs one (cosine, linear); a constant one
    needs none."""

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int | None = None
    end_lr_fraction: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0

    def __post_init__(self):
        check_choice("optimizer.schedule", self.schedule, SCHEDULES)
        if not self.learning_rate > 0:
            raise ValueError(f"optimizer.learning_rate={self.learning_rate!r}: must be > 0")
        check_int("optimizer.warmup_steps", self.warmup_steps, low=0)
        if self.total_steps is not None:
            check_int("optimizer.total_steps", self.total_steps, low=1)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"optimizer.max_grad_norm={self.max_grad_norm!r}: must be > 0 or None")
        check_range("optimizer.b1", self.b1, low=0, high=1, high_open=True)
        check_range("optimizer.b2", self.b2, low=0, high=1, high_open=True)
        check_range("optimizer.eps", self.eps, low=0, low_open=True)
        check_range("optimizer.weight_decay", self.weight_decay, low=0)
        check_range("optimizer.end_lr_fraction", self.end_lr_fraction, low=0, high=1)
        check_range("optimizer.learning_rate", self.learning_rate, low=0, low_open=True)

    def with_length(self, updates: int) -> "OptimizerConfig":
        """This config with total_steps = updates when it follows the run (None); an explicit
        total_steps stays."""
        if self.total_steps is not None:
            return self
        return dataclasses.replace(self, total_steps=updates)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """The learning rate at each optimizer update (the count optax keeps: 0 for the first)."""
    if cfg.total_steps is None and cfg.schedule != "constant":
        raise ValueError(f"optimizer.schedule={cfg.schedule!r} needs a length: "
                         "optimizer.total_steps is None (follow the run), which a run config "
                         "resolves (RunConfig.resolved_optimizer); outside one set it, or call "
                         "OptimizerConfig.with_length(updates)")
    decay_steps = max((cfg.total_steps or 1) - cfg.warmup_steps, 1)
    end = cfg.learning_rate * cfg.end_lr_fraction
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.learning_rate)
    elif cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps,
                                           alpha=cfg.end_lr_fraction)
    else:
        main = optax.linear_schedule(cfg.learning_rate, end, decay_steps)
    if cfg.warmup_steps == 0:
        return main
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return optax.join_schedules([warmup, main], [cfg.warmup_steps])


def learning_rate_at(cfg: OptimizerConfig, step: int) -> float:
    """The schedule's learning rate at optimizer update `step` (train/lr)."""
    return float(learning_rate_schedule(cfg)(step))


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts)
