"""Llama 3's RoPE frequency scaling (rope_type "llama3"): the rule by hand, a model whose
scaling moves its logits (their match with transformers is the llama_rope3 kind of
tests/models/test_hf_checkpoint.py's family table), the config.json round trip, and one clear
error for inverted bands."""

from __future__ import annotations

import dataclasses
import json
import math

import jax.numpy as jnp

import numpy as np
import pytest

from jrl.models import config_from_hf, config_to_hf, forward_logits, load
from jrl.models.blocks.attention import llama3_inv_freq
from jrl.models.config import ModelConfig, RopeScaling
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


def test_the_llama3_scaling_moves_the_logits(tiny_hf_checkpoints):
    directory, _ = tiny_hf_checkpoints["llama_rope3"]
    model = load(directory, contract=XLA)
    assert model.config.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)
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
