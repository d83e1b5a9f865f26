"""Train state, optimizer and the pure train step."""

from jrl.train.optimizer import (OptimizerConfig, learning_rate_at, learning_rate_schedule,
                                 make_optimizer)
from jrl.train.programs import clear_shared_programs, shared_program
from jrl.train.state import SFTBatch, TrainBatch, TrainState, create_train_state
from jrl.train.step import (jit_train_step, make_logprob_fn, make_score_fn, make_sft_step,
                            make_train_step)
from jrl.train.parallel_step import (make_parallel_logprob_fn, make_parallel_score_fn,
                                     make_parallel_train_step, ordered_shard_sum)

__all__ = [
    "OptimizerConfig", "clear_shared_programs", "learning_rate_at", "learning_rate_schedule",
    "make_optimizer",
    "SFTBatch", "TrainBatch", "TrainState", "create_train_state", "jit_train_step", "make_logprob_fn",
    "make_parallel_logprob_fn", "make_parallel_score_fn", "make_parallel_train_step",
    "make_score_fn", "make_sft_step", "make_train_step", "ordered_shard_sum", "shared_program",
]
