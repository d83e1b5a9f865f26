"""A second trainer with the same settings compiles nothing: its programs are the first one's
(jrl.train.programs); other settings get their own."""

import jax
import jax.monitoring

from jrl import losses
from jrl.pipeline import PrepareOptions, Trainer, TrainerOptions
from jrl.train import clear_shared_programs
from tests.pipeline.test_custom_loop import custom_loop, parity_reward

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _compiles_during(fn):
    events = []

    def listener(event, duration, **_):
        if event == _BACKEND_COMPILE:
            events.append(duration)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        result = fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return result, len(events)


def test_an_equal_trainer_reuses_the_compiled_programs_and_another_loss_does_not():
    # Another test in this process may have built an equal trainer already: start empty, so
    # the first trainer compiles its programs (the sampler's may be compiled already).
    clear_shared_programs()

    def one_step():
        return custom_loop(losses.recipes.dr_grpo(max_len=8), parity_reward, steps=1)
    (first, first_log), first_compiles = _compiles_during(one_step)
    (second, second_log), second_compiles = _compiles_during(one_step)
    assert first_compiles > 0                     # the listener sees compiles (not vacuous)
    assert second._train_step is first._train_step
    assert second._logprobs is first._logprobs and second._scores is first._scores
    # Sampler programs were already shared by spec; now the train side is too.
    assert second_compiles == 0
    assert first_log[0][2]["train/loss"] == second_log[0][2]["train/loss"]

    # GSPO's chain (the sequence-ratio objective): its own train step.
    recipe = losses.recipes.gspo()
    third = Trainer(TrainerOptions(PrepareOptions(rows=16, seq_len=32)),
                    first.model_config, first.params_on_host(), [jax.devices()[0]],
                    contract=first.contract, recipe=recipe)
    assert third._train_step is not first._train_step
    batch = first_log[0][1].batch
    _, third_compiles = _compiles_during(lambda: third.train_on(batch, 0))
    assert third_compiles >= 1
