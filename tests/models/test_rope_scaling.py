"""RoPE frequency scaling, Llama 3's (rope_type "llama3") and YaRN (rope_type "yarn"): the rules
by hand, models whose scaling moves their logits (their match with transformers is the
llama_rope3, qwen3_yarn and qwen2_yarn kinds of tests/models/test_hf_checkpoint.py's family
table), the config.json round trips, and clear errors for what is not expressed."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp

import numpy as np
import pytest

from jrl.models import config_from_hf, config_to_hf, forward_logits, load
from jrl.models.blocks.attention import llama3_inv_freq, rotary_tables, yarn_inv_freq
from jrl.models.config import ModelConfig, RopeScaling, YarnScaling
from .helpers import XLA, right_padded_batch


def test_the_scaled_frequencies_follow_the_rule_by_hand():
    # f = [1, 0.1, 0.01, 0.001] (theta 10^4, rotary dim 8), wavelengths 2 pi / f =
    # [6.28, 62.8, 628, 6283]; L = 64, factor 8, low 1, high 4: w_low = 64 / 1 = 64,
    # w_high = 64 / 4 = 16.
    #   6.28 < 16        -> kept:          1
    #   16 <= 62.8 <= 64 -> blended:       s = (64 / 62.83 - 1) / (4 - 1) = 0.0061973,
    #                                      (1 - s) * 0.1 / 8 + s * 0.1 = 0.0130423
    #   628, 6283 > 64   -> interpolated:  0.01 / 8 = 0.00125, 0.001 / 8 = 0.000125
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)
    inv_freq = jnp.asarray([1.0, 0.1, 0.01, 0.001], jnp.float32)
    s = (64 / (2 * math.pi / 0.1) - 1) / 3
    expected = [1.0, (1 - s) * 0.1 / 8 + s * 0.1, 0.00125, 0.000125]
    assert abs(expected[1] - 0.0130423) < 1e-7
    np.testing.assert_allclose(np.asarray(llama3_inv_freq(inv_freq, scaling)), expected,
                               rtol=1e-6)


@pytest.mark.parametrize("kind, scaling", [
    ("llama_rope3", RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=32)),
    ("qwen3_yarn", YarnScaling(factor=4.0, original_max_position_embeddings=64)),
    ("qwen2_yarn", YarnScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=16.0,
                               beta_slow=2.0, attention_factor=1.25, truncate=False)),
])
def test_the_scaling_moves_the_logits(tiny_hf_checkpoints, kind, scaling):
    directory, _ = tiny_hf_checkpoints[kind]
    model = load(directory, contract=XLA)
    assert model.config.rope_scaling == scaling
    tokens, mask = right_padded_batch(model.config.vocab_size, (9, 5, 1))
    scaled = np.asarray(model(tokens, mask=mask))
    unscaled_config = dataclasses.replace(model.config, rope_scaling=None)
    unscaled = np.asarray(forward_logits(model.params, unscaled_config, tokens, mask=mask,
                                         contract=XLA))
    # The scaling moves the logits far beyond the 1e-4 the transformers comparison allows.
    assert np.abs(scaled[mask] - unscaled[mask]).max() > 1e-2


def test_the_scaling_round_trips_through_config_json():
    config = ModelConfig(rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=8192))
    written = json.loads(json.dumps(config_to_hf(config, "float32")))
    assert written["rope_scaling"]["rope_type"] == "llama3"
    assert written["rope_parameters"]["factor"] == 32.0
    assert config_from_hf(written) == config


def test_inverted_bands_are_one_error_naming_the_block():
    # An unknown type and a missing field: tests/models/test_hf_checkpoint.py.
    written = config_to_hf(ModelConfig(), "float32")
    written["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                               "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    del written["rope_parameters"]
    with pytest.raises(ValueError, match=r"^config\.json: rope_scaling: high_freq_factor=1\.0 "
                                         r"must exceed low_freq_factor=4\.0$"):
        config_from_hf(written)


# ------------------------------------------------------------------------------------------------
# YaRN


# theta 10^4 and d = 8 make YaRN's correction dim c(r) = 8 ln(L / (2 pi r)) / (2 ln 10^4)
# = log10(L / (2 pi r)); L = 4096: c(32) = log10(20.372) = 1.30903, c(1) = log10(651.90) = 2.81418.
YARN_BY_HAND = YarnScaling(factor=4.0, original_max_position_embeddings=4096)


def test_the_yarn_frequencies_follow_the_rule_by_hand():
    # f = [1, 0.1, 0.01, 0.001]. Truncated: low = floor(1.309) = 1, high = ceil(2.814) = 3, so
    # ramp = clip((i - 1) / 2) = [0, 0, 0.5, 1]: f' = f (1 - ramp) + f / 4 ramp
    # = [1, 0.1, 0.5 * 0.01 + 0.5 * 0.0025 = 0.00625, 0.001 / 4 = 0.00025].
    np.testing.assert_allclose(np.asarray(yarn_inv_freq(1e4, 8, YARN_BY_HAND)),
                               [1.0, 0.1, 0.00625, 0.00025], rtol=1e-6)
    # Not truncated: ramp_i = (i - 1.30903) / 1.50515 = [0, 0, 0.459070, 1] (clipped):
    # f'_2 = 0.01 (1 - 0.459070 * 3 / 4) = 0.00655697.
    untruncated = dataclasses.replace(YARN_BY_HAND, truncate=False)
    np.testing.assert_allclose(np.asarray(yarn_inv_freq(1e4, 8, untruncated)),
                               [1.0, 0.1, 0.00655697, 0.00025], rtol=1e-5)


def test_the_attention_factor_scales_cos_and_sin():
    # Position 1 sees angles f' itself; the tables are 0.1 ln 4 + 1 = 1.1386294 times cos and
    # sin of them, or attention_factor times when it is given.
    angles = np.asarray([1.0, 0.1, 0.00625, 0.00025])
    positions = jnp.ones((1, 1), jnp.int32)
    for scaling, magnitude in ((YARN_BY_HAND, 1.1386294),
                               (dataclasses.replace(YARN_BY_HAND, attention_factor=0.5), 0.5)):
        cos, sin = rotary_tables(positions, 1e4, 8, scaling)
        np.testing.assert_allclose(np.asarray(cos)[0, 0, 0], magnitude * np.cos(angles),
                                   rtol=1e-5)
        np.testing.assert_allclose(np.asarray(sin)[0, 0, 0], magnitude * np.sin(angles),
                                   rtol=1e-5)
    assert YarnScaling(factor=1.0).attention_scale == 1.0  # no extension: unscaled magnitude


def test_a_decode_step_sees_the_train_forwards_yarn_tables():
    # The train forward computes the tables for a whole sequence, a decode step for one
    # position at a time: the same function, the same bits.
    scaling = dataclasses.replace(YARN_BY_HAND, truncate=False)
    whole = jax.jit(lambda: rotary_tables(jnp.arange(12, dtype=jnp.int32)[None], 1e4, 8,
                                          scaling))()
    one = jax.jit(lambda p: rotary_tables(p, 1e4, 8, scaling))
    for t in range(12):
        cos, sin = one(jnp.full((1, 1), t, jnp.int32))
        assert np.array_equal(np.asarray(cos)[0, 0], np.asarray(whole.cos)[0, t])
        assert np.array_equal(np.asarray(sin)[0, 0], np.asarray(whole.sin)[0, t])


def test_the_yarn_scaling_round_trips_through_config_json():
    for scaling in (YARN_BY_HAND, YarnScaling(factor=2.0, original_max_position_embeddings=512,
                                              beta_fast=8.0, beta_slow=0.5,
                                              attention_factor=1.5, truncate=False)):
        config = ModelConfig(model_type="qwen3", qk_norm=True, rope_scaling=scaling)
        written = json.loads(json.dumps(config_to_hf(config, "float32")))
        assert written["rope_parameters"]["rope_type"] == "yarn"
        # An unset attention factor is not written (transformers derives the same one).
        assert ("attention_factor" in written["rope_scaling"]) == (
            scaling.attention_factor is not None)
        assert config_from_hf(written) == config
        assert ModelConfig.from_dict(config.to_dict()) == config


def _yarn_json(block: dict, **top) -> dict:
    written = config_to_hf(ModelConfig(model_type="qwen3", qk_norm=True,
                                       max_position_embeddings=1024), "float32")
    del written["rope_parameters"]
    written.update(rope_scaling={"rope_type": "yarn", **block}, **top)
    return written


def test_original_max_position_embeddings_defaults_as_in_transformers():
    # transformers' standardize_rope_params: the block's, else a top-level one, else
    # max_position_embeddings.
    assert config_from_hf(_yarn_json({"factor": 4.0})).rope_scaling == YarnScaling(
        factor=4.0, original_max_position_embeddings=1024)
    assert config_from_hf(_yarn_json(
        {"factor": 4.0}, original_max_position_embeddings=256)).rope_scaling == YarnScaling(
        factor=4.0, original_max_position_embeddings=256)
    # A null optional field takes transformers' default too (beta_fast or 32).
    assert config_from_hf(_yarn_json(
        {"factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": None})
    ).rope_scaling.beta_fast == 32.0


@pytest.mark.parametrize("block, top, message", [
    ({"original_max_position_embeddings": 256}, {},
     r"^config\.json: rope_scaling of rope_type 'yarn' lacks 'factor' \(it has "
     r"\['original_max_position_embeddings', 'rope_type'\]\)$"),
    ({"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707}, {},
     r"^config\.json: rope_scaling\.mscale=0\.707: DeepSeek's YaRN attention scaling is not "
     r"supported"),
    ({"factor": 4.0, "beta_fast": 1.0, "beta_slow": 2.0}, {},
     r"^config\.json: rope_scaling: beta_fast=1\.0 must exceed beta_slow=2\.0$"),
    ({"factor": -1.0}, {}, r"^config\.json: rope_scaling\.factor=-1\.0: must be a finite "
                           r"number > 0$"),
    ({"factor": 4.0, "truncate": "yes"}, {},
     r"^config\.json: rope_scaling\.truncate='yes': must be true or false$"),
    ({"factor": 4.0, "original_max_position_embeddings": 256},
     {"original_max_position_embeddings": 512},
     r"^config\.json: original_max_position_embeddings=512 disagrees with "
     r"rope_scaling\.original_max_position_embeddings=256$"),
])
def test_a_yarn_block_jrl_cannot_express_is_one_error_naming_the_field(block, top, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(_yarn_json(block, **top))


def test_a_saved_config_names_the_allowed_scalings():
    with pytest.raises(ValueError, match=r"^rope_scaling\.rope_type='linear': allowed: "
                                         r"\['llama3', 'yarn'\]"):
        ModelConfig.from_dict({**ModelConfig().to_dict(),
                               "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
