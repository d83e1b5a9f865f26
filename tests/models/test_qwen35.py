"""Qwen3.5 (Gated DeltaNet + gated attention): jrl's forward against transformers on tiny random
checkpoints built here, in both checkpoint forms, and the save_hf round trip."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.models import config_from_hf, load, load_hf, save_hf
from jrl.models.transformer import forward_logits
from .helpers import (QWEN35_TEXT, XLA, add_tensors, right_padded_batch, save_tiny_hf,
                      tiny_qwen35_model, tiny_qwen35_multimodal, transformers_logits)

PALLAS = NumericalContract(backend="pallas")
# Lengths around the delta chunk (16): a row inside the first chunk, one across two chunks.
LENGTHS = (37, 16, 5)


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    model = tiny_qwen35_model(seed=0)
    return save_tiny_hf(model, tmp_path_factory.mktemp("qwen35")), model


@pytest.mark.parametrize("contract", [XLA, PALLAS], ids=["xla", "pallas"])
def test_logits_match_transformers(text_checkpoint, contract):
    directory, torch_model = text_checkpoint
    model = load(directory, contract=contract)
    config = model.config
    assert config.model_type == "qwen3_5_text" and config.attn_output_gate
    assert config.norm_offset == 1.0 and config.rotary_dim == 4
    assert config.layer_types == tuple(QWEN35_TEXT["layer_types"])
    tokens, mask = right_padded_batch(config.vocab_size, LENGTHS)
    ours = np.asarray(model(tokens, mask=mask))
    theirs = transformers_logits(torch_model, tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)
    assert np.abs(theirs[mask]).max() > 0.5     # far from uniform: the check is not vacuous


def test_the_conditional_generation_form_loads_its_text_model(tmp_path):
    """The Hub's Qwen3_5ForConditionalGeneration: text_config, weights under
    model.language_model, a vision tower and an MTP head, both skipped with one note."""
    torch_model = tiny_qwen35_multimodal(seed=3)
    directory = save_tiny_hf(torch_model, tmp_path / "mm")
    add_tensors(directory, {"mtp.fc.weight": np.ones((48, 96), np.float32),
                            "mtp.norm.weight": np.ones((48,), np.float32)})
    notes = []
    config, params = load_hf(directory, dtype="float32", log=notes.append)
    assert config.model_type == "qwen3_5_text" and config.num_layers == 5
    assert len(notes) == 1 and "model.visual.*" in notes[0] and "mtp.*" in notes[0]
    tokens, mask = right_padded_batch(config.vocab_size, (11, 4))
    ours = np.asarray(forward_logits(params, config, tokens, contract=XLA, mask=mask))
    theirs = transformers_logits(torch_model, tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)


def test_save_hf_round_trip_through_transformers(text_checkpoint, tmp_path):
    """jrl writes a text-only Qwen3_5ForCausalLM directory that transformers loads and runs
    with jrl's logits; a bf16 sharded save loads back bit for bit."""
    import transformers

    directory, _ = text_checkpoint
    config, params = load_hf(directory, dtype="float32")
    save_hf(tmp_path / "out", config, params, dtype="float32")
    saved = json.load(open(tmp_path / "out" / "config.json"))
    assert saved["model_type"] == "qwen3_5_text"
    assert saved["architectures"] == ["Qwen3_5ForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens, mask = right_padded_batch(config.vocab_size, (9, 3))
    ours = np.asarray(forward_logits(params, config, tokens, contract=XLA, mask=mask))
    np.testing.assert_allclose(ours[mask], transformers_logits(reloaded, tokens, mask)[mask],
                               atol=1e-4, rtol=0)
    assert config_from_hf(saved) == config

    save_hf(tmp_path / "bf16", config, params, dtype="bfloat16", max_shard_bytes=20_000)
    shards = [n for n in os.listdir(tmp_path / "bf16") if n.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(tmp_path / "bf16" / "model.safetensors.index.json")
    config16, params16 = load_hf(tmp_path / "bf16")
    assert config16 == config
    assert str(params16["layers_deltanet"]["w_qkv"].dtype) == "bfloat16"


def test_tied_embeddings_and_every_fourth_default_layout(tmp_path):
    """No layer_types in config.json: transformers' default, every 4th layer full attention."""
    torch_model = tiny_qwen35_model(seed=5, tie_word_embeddings=True, num_hidden_layers=4,
                                    layer_types=None)
    directory = save_tiny_hf(torch_model, tmp_path / "tied")
    raw = json.load(open(os.path.join(directory, "config.json")))
    raw.pop("layer_types", None)
    json.dump(raw, open(os.path.join(directory, "config.json"), "w"))
    config, params = load_hf(directory, dtype="float32")
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.tie_word_embeddings and "lm_head" not in params
    tokens, mask = right_padded_batch(config.vocab_size, (20,))
    ours = np.asarray(forward_logits(params, config, tokens, contract=XLA, mask=mask))
    np.testing.assert_allclose(ours[mask], transformers_logits(torch_model, tokens, mask)[mask],
                               atol=1e-4, rtol=0)
