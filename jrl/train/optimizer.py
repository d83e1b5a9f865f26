"""AdamW with global-norm clipping and a warmup + (constant | cosine | linear) schedule."""

from __future__ import annotations

import dataclasses

import optax

from jrl.checks import check_choice, check_range

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 1000
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
        if self.warmup_steps < 0 or self.total_steps <= 0:
            raise ValueError("optimizer.warmup_steps must be >= 0 and optimizer.total_steps > 0 "
                             f"(got {self.warmup_steps}, {self.total_steps})")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"optimizer.max_grad_norm={self.max_grad_norm!r}: must be > 0 or None")
        check_range("optimizer.b1", self.b1, low=0, high=1, high_open=True)
        check_range("optimizer.b2", self.b2, low=0, high=1, high_open=True)
        check_range("optimizer.eps", self.eps, low=0, low_open=True)
        check_range("optimizer.weight_decay", self.weight_decay, low=0)
        check_range("optimizer.end_lr_fraction", self.end_lr_fraction, low=0, high=1)
        check_range("optimizer.learning_rate", self.learning_rate, low=0, low_open=True)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
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


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts)
