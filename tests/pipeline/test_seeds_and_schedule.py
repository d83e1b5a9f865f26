"""The learning-rate schedule's length follows the run, and the top-level seed seeds the whole
run (issue 47 item 7): hand-checked values, overrides, explicit values and the config.json
round trip."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jrl import configs
from jrl.cli import train as train_cli
from jrl.pipeline.setup.data import build_data
from jrl.pipeline.setup.model import build_model
from jrl.pipeline.config import RunConfig, SamplingSection
from jrl.pipeline.config.tools import apply_overrides, from_dict, to_dict
from jrl.pipeline.loop.resume import _resolved_dict, dict_diffs
from jrl.pipeline.setup.options import trainer_options
from jrl.sampling.params import SamplingParams
from jrl.train.optimizer import OptimizerConfig, learning_rate_at, learning_rate_schedule

from .tiny import tiny_config


def _run(*overrides: str) -> RunConfig:
    return apply_overrides(RunConfig(), list(overrides))


# ---------------------------------------------------------------------------------------------
# optimizer.total_steps


def test_total_steps_defaults_to_every_update_of_the_run():
    assert OptimizerConfig().total_steps is None
    # 10 RL steps x 2 mini-batches x 3 epochs = 60 optimizer updates.
    cfg = _run("train.steps=10", "train.mini_batches=2", "train.epochs=3")
    assert cfg.optimizer.total_steps is None
    assert cfg.resolved_optimizer().total_steps == 60
    assert trainer_options(cfg).optimizer.total_steps == 60
    # The default run: 40 steps x 1 update.
    assert RunConfig().resolved_optimizer().total_steps == 40


def test_total_steps_follows_a_set_train_steps_override():
    cfg = _run("train.steps=10", "train.mini_batches=2")
    assert cfg.resolved_optimizer().total_steps == 20
    shorter = apply_overrides(cfg, ["train.steps=4"])
    assert shorter.resolved_optimizer().total_steps == 8       # 4 x 2


def test_an_explicit_total_steps_stays():
    cfg = _run("train.steps=10", "optimizer.total_steps=100")
    assert cfg.resolved_optimizer().total_steps == 100
    assert apply_overrides(cfg, ["train.steps=3", "train.epochs=2"]
                           ).resolved_optimizer().total_steps == 100
    # Back to following the run.
    assert apply_overrides(cfg, ["optimizer.total_steps=none"]
                           ).resolved_optimizer().total_steps == 10


def test_the_learning_rate_at_a_step_by_hand():
    cfg = _run("optimizer.learning_rate=1e-3", "optimizer.schedule=cosine",
               "optimizer.warmup_steps=2", "optimizer.end_lr_fraction=0.1", "train.steps=10")
    optimizer = cfg.resolved_optimizer()
    # Warmup: 0 -> 1e-3 linearly over 2 updates; update 1 is halfway: 5e-4.
    assert learning_rate_at(optimizer, 1) == pytest.approx(5e-4)
    # Cosine over total_steps - warmup = 10 - 2 = 8 updates from update 2. At update 6, 4 of
    # the 8 are done: 1e-3 * (0.1 + 0.9 * 0.5 * (1 + cos(pi * 4 / 8))) = 1e-3 * (0.1 + 0.45)
    # = 5.5e-4.
    assert learning_rate_at(optimizer, 6) == pytest.approx(5.5e-4)
    # The end of the run (update 10): the floor, 1e-3 * 0.1 = 1e-4.
    assert learning_rate_at(optimizer, 10) == pytest.approx(1e-4)
    # Twice the run, twice the schedule: 18 decay updates, at update 6 again 4 done:
    # 1e-3 * (0.1 + 0.9 * 0.5 * (1 + cos(pi * 4 / 18))) = 1e-3 * (0.1 + 0.45 * 1.766044)
    # = 8.94720e-4.
    longer = apply_overrides(cfg, ["train.steps=20"]).resolved_optimizer()
    assert learning_rate_at(longer, 6) == pytest.approx(8.94720e-4, rel=1e-5)
    assert 1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * 4 / 18))) == pytest.approx(8.94720e-4,
                                                                                   rel=1e-5)
    # Linear to 0 over 10 updates without warmup: update 4 is 1e-3 * (1 - 4/10) = 6e-4.
    linear = _run("optimizer.learning_rate=1e-3", "optimizer.schedule=linear", "train.steps=5",
                  "train.mini_batches=2").resolved_optimizer()
    assert linear.total_steps == 10
    assert learning_rate_at(linear, 4) == pytest.approx(6e-4)


def test_a_schedule_without_a_length_outside_a_run_is_refused():
    constant = OptimizerConfig(learning_rate=1e-3)   # needs no length
    assert float(learning_rate_schedule(constant)(12345)) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="optimizer.total_steps is None"):
        learning_rate_schedule(OptimizerConfig(schedule="cosine"))
    assert OptimizerConfig(schedule="cosine").with_length(7).total_steps == 7
    assert OptimizerConfig(total_steps=3).with_length(7).total_steps == 3
    with pytest.raises(ValueError, match="optimizer.total_steps=0"):
        OptimizerConfig(total_steps=0)


@pytest.mark.parametrize("name,updates", [("arith_tiny", 120), ("arith_tiny_async", 120),
                                          ("calc_tiny", 80), ("gsm8k_qwen3_sync", 120),
                                          ("gsm8k_qwen3_async", 120), ("smollm2_arith", 36),
                                          ("smollm2_calc", 12)])
def test_shipped_configs_keep_their_schedule_length(name, updates):
    # Each set total_steps = train.steps (one update per step) before following the run.
    cfg = train_cli.load_config(name, [])
    assert cfg.optimizer.total_steps is None
    assert cfg.resolved_optimizer().total_steps == updates


# ---------------------------------------------------------------------------------------------
# seeds


def test_the_defaults_keep_every_seed_at_zero():
    cfg = RunConfig()
    assert (cfg.model.init_seed, cfg.model.lora.seed, cfg.data.seed, cfg.sampling.seed) == \
        (None, None, None, None)
    assert tuple(cfg.seeds()) == (0, 0, 0, 0, 0)
    resolved = cfg.resolved_sampling()
    assert type(resolved) is SamplingParams and resolved.seed == 0
    for name in configs.names():
        assert tuple(train_cli.load_config(name, []).seeds()) == (0, 0, 0, 0, 0), name


def test_the_top_level_seed_seeds_every_section():
    cfg = _run("seed=7")
    seeds = cfg.seeds()
    assert (seeds.train, seeds.model_init, seeds.lora, seeds.data, seeds.sampling) == \
        (7, 7, 7, 7, 7)
    assert cfg.resolved_sampling().seed == 7
    # Applied on top of a shipped config, as `jrl train --config arith_tiny --set seed=3` does.
    assert tuple(train_cli.load_config("arith_tiny", ["seed=3"]).seeds()) == (3, 3, 3, 3, 3)


def test_an_explicit_section_seed_wins():
    cfg = _run("seed=7", "data.seed=1", "sampling.seed=2", "model.init_seed=3",
               "model.lora.seed=4")
    assert tuple(cfg.seeds()) == (7, 3, 4, 1, 2)
    assert cfg.resolved_sampling().seed == 2
    # A later top-level change leaves them.
    assert tuple(apply_overrides(cfg, ["seed=9"]).seeds()) == (9, 3, 4, 1, 2)
    # An explicit 0 is a seed too.
    assert _run("seed=7", "data.seed=0").seeds().data == 0


def test_a_plain_sampling_params_becomes_the_section():
    # SamplingParams cannot leave its seed unset: its default 0 is read as unset.
    unset = RunConfig(seed=5, sampling=SamplingParams(group_size=8))
    assert isinstance(unset.sampling, SamplingSection) and unset.sampling.seed is None
    assert unset.resolved_sampling().seed == 5
    kept = RunConfig(seed=5, sampling=SamplingParams(group_size=8, seed=11))
    assert kept.sampling.seed == 11 and kept.resolved_sampling().seed == 11
    assert RunConfig(sampling=SamplingParams(group_size=8)) == RunConfig()
    with pytest.raises(ValueError, match="SamplingParams.top_p=1.5"):
        SamplingSection(top_p=1.5)
    with pytest.raises(ValueError, match=r"sampling.seed=-1: must be an int in \[0, 2\*\*32\)"):
        _run("sampling.seed=-1")


def test_the_seeds_reach_the_data_and_the_model():
    def examples(*overrides):
        train, _ = build_data(tiny_config(*overrides), log=lambda _: None)
        return [e.question for e in train]
    assert examples("seed=3") == examples("data.seed=3") == examples("seed=5", "data.seed=3")
    assert examples("seed=3") != examples()

    def params(*overrides):
        return build_model(tiny_config(*overrides))[1]["embed"]
    assert bool(jnp.array_equal(params("seed=3"), params("model.init_seed=3")))
    assert not bool(jnp.array_equal(params("seed=3"), params()))


# ---------------------------------------------------------------------------------------------
# config.json


def test_the_new_fields_round_trip_through_config_json():
    for cfg in (RunConfig(), _run("seed=7", "train.steps=9"),
                _run("seed=7", "data.seed=1", "sampling.seed=2", "model.init_seed=3",
                     "model.lora.seed=4", "optimizer.total_steps=50")):
        data = json.loads(json.dumps(to_dict(cfg)))
        back = from_dict(RunConfig, data)
        assert back == cfg
        assert tuple(back.seeds()) == tuple(cfg.seeds())
        assert back.resolved_optimizer() == cfg.resolved_optimizer()
    data = to_dict(RunConfig())
    assert (data["seed"], data["model"]["init_seed"], data["model"]["lora"]["seed"],
            data["data"]["seed"], data["sampling"]["seed"], data["optimizer"]["total_steps"]) == \
        (0, None, None, None, None, None)


def test_an_old_config_json_loads_with_its_values(tmp_path):
    # config.json as runs wrote it before: every seed and total_steps explicit.
    data = to_dict(RunConfig())
    data["model"]["init_seed"] = data["model"]["lora"]["seed"] = 0
    data["data"]["seed"] = data["sampling"]["seed"] = 0
    data["optimizer"]["total_steps"] = 1000
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    cfg = train_cli.load_config(str(path), [])
    assert cfg.resolved_optimizer().total_steps == 1000
    assert tuple(cfg.seeds()) == (0, 0, 0, 0, 0)
    # Resuming it with a longer run keeps its schedule, and its section seeds stay explicit.
    longer = train_cli.load_config(str(path), ["train.steps=400", "seed=2"])
    assert longer.resolved_optimizer().total_steps == 1000
    assert tuple(longer.seeds()) == (2, 0, 0, 0, 0)
    assert np.isclose(learning_rate_at(longer.resolved_optimizer(), 0), 1e-6)


def test_resume_compares_the_values_seeds_and_schedule_took():
    # A checkpoint written before: explicit zeros, total_steps = train.steps (40) and the
    # train.reference / old_logp that the recipe resolves to.
    saved = to_dict(RunConfig())
    saved["model"]["init_seed"] = saved["model"]["lora"]["seed"] = 0
    saved["data"]["seed"] = saved["sampling"]["seed"] = 0
    saved["optimizer"]["total_steps"] = 40
    saved["train"].update(reference="none", old_logp="behavior")
    assert RunConfig().resolved() == from_dict(RunConfig, saved)
    assert dict_diffs(_resolved_dict(saved, print), to_dict(RunConfig().resolved())) == []
    # The same run with another seed and a longer run: each value it changes is named.
    changed = _run("seed=5", "train.steps=50").resolved()
    assert dict_diffs(_resolved_dict(to_dict(RunConfig()), print), to_dict(changed)) == [
        "data.seed: 0 -> 5", "model.init_seed: 0 -> 5", "model.lora.seed: 0 -> 5",
        "optimizer.total_steps: 40 -> 50", "sampling.seed: 0 -> 5", "seed: 0 -> 5",
        "train.steps: 40 -> 50"]
