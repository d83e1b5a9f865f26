"""Qwen3-MoE and Qwen3.5-MoE: jrl's forward against transformers on tiny random checkpoints built
here, both expert storage formats, and the save_hf round trip read back by transformers.

transformers 5 holds experts as stacked 3-D parameters (experts.gate_up_proj [E, 2F, D],
experts.down_proj [E, D, F]) but `save_pretrained` writes the Hub's per-expert layout
(experts.{e}.gate_proj.weight ...); the stacked file is made here by rewriting the safetensors
(helpers.fuse_experts, numpy only), and transformers itself loads it as a cross-check that it is
the layout transformers means.
"""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.models import config_from_hf, load_hf, save_hf
from jrl.models import transformer
from .helpers import (QWEN3_MOE, XLA, expert_tensor_names, fuse_experts, right_padded_batch,
                      save_tiny_hf, tiny_qwen3_moe_model, tiny_qwen35_moe_model,
                      transformers_logits)

# Small tiles: the Pallas path runs several row tiles per expert group and K tiles.
PALLAS = NumericalContract(backend="pallas", matmul_block_m=8, matmul_block_n=16,
                           matmul_block_k=16, norm_block_rows=8, logprob_block_rows=8,
                           attn_block_q=8, attn_block_k=8, vocab_chunk=16, delta_chunk=8)
# Across the delta chunk (8) and the row tiles; one row shorter than a tile.
LENGTHS = (19, 8, 3)


@functools.partial(jax.jit, static_argnames=("config", "contract"))
def _logits_and_experts(params, tokens, mask, *, config, contract):
    out = transformer.forward(params, config, tokens, contract=contract, mask=mask)
    return transformer.logits_from_hidden(params, out.hidden, contract=contract), out.experts


def logits_and_experts(params, config, tokens, mask, contract):
    """(logits [B, T, V], experts {kind key: [n, B, T, k]}) of jrl's forward, as numpy."""
    logits, experts = _logits_and_experts(params, tokens, mask, config=config,
                                          contract=contract)
    return np.asarray(logits), {k: np.asarray(v) for k, v in experts.items()}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """(per-expert directory, fused directory, the transformers model)."""
    model = tiny_qwen3_moe_model(seed=0)
    root = tmp_path_factory.mktemp("qwen3_moe")
    per_expert = save_tiny_hf(model, root / "per_expert")
    return per_expert, fuse_experts(per_expert, root / "fused"), model


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory):
    model = tiny_qwen35_moe_model(seed=2)
    return save_tiny_hf(model, tmp_path_factory.mktemp("qwen35_moe")), model


def test_the_two_expert_layouts_are_what_the_test_claims(qwen3_moe):
    per_expert, fused, _ = qwen3_moe
    names = expert_tensor_names(per_expert)
    # 2 sparse layers (0 and 2; layer 1 is in mlp_only_layers) x 5 experts x 3 projections.
    assert len(names) == 2 * 5 * 3 and "model.layers.0.mlp.experts.4.down_proj.weight" in names
    assert expert_tensor_names(fused) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 2)
                                          for p in ("down_proj", "gate_up_proj")]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_qwen3_moe_logits_match_transformers(qwen3_moe, layout):
    per_expert, fused, torch_model = qwen3_moe
    config, params = load_hf(per_expert if layout == "per_expert" else fused, dtype="float32")
    assert config.model_type == "qwen3_moe" and config.num_experts == 5
    assert config.layer_kinds == (("attention", "moe"), ("attention", "dense"),
                                  ("attention", "moe"))
    assert params["layers_moe"]["experts_gate"].shape == (2, 5, 40, 20)
    tokens, mask = right_padded_batch(config.vocab_size, LENGTHS)
    ours, experts = logits_and_experts(params, config, tokens, mask, XLA)
    theirs = transformers_logits(torch_model, tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)
    assert np.abs(theirs[mask]).max() > 0.5     # far from uniform: the check is not vacuous
    # Routing is real: every expert serves some token, and tokens disagree on their experts.
    used = experts["layers_moe"][:, mask]                              # [2, tokens, k]
    assert sorted(np.unique(used).tolist()) == [0, 1, 2, 3, 4]


def test_the_fused_checkpoint_loads_to_the_same_params_and_transformers_agrees(qwen3_moe):
    """Both layouts give bit-identical params; transformers reads the rewritten fused file to
    the same logits as its own save (the rewrite is transformers' own stacked layout)."""
    import transformers

    per_expert, fused, torch_model = qwen3_moe
    _, a = load_hf(per_expert, dtype="float32")
    _, b = load_hf(fused, dtype="float32")
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(fused).eval()
    tokens, mask = right_padded_batch(QWEN3_MOE["vocab_size"], (7, 4))
    np.testing.assert_array_equal(transformers_logits(reloaded, tokens, mask),
                                  transformers_logits(torch_model, tokens, mask))


def test_qwen3_moe_pallas_logits_match_transformers(qwen3_moe):
    per_expert, _, torch_model = qwen3_moe
    config, params = load_hf(per_expert, dtype="float32")
    tokens, mask = right_padded_batch(config.vocab_size, LENGTHS)
    ours, _ = logits_and_experts(params, config, tokens, mask, PALLAS)
    np.testing.assert_allclose(ours[mask], transformers_logits(torch_model, tokens, mask)[mask],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("changes", [dict(norm_topk_prob=True),
                                     dict(decoder_sparse_step=2, mlp_only_layers=[])],
                         ids=["norm_topk_prob", "decoder_sparse_step2"])
def test_qwen3_moe_variants_match_transformers(tmp_path, changes):
    """norm_topk_prob renormalises the top-k weights; decoder_sparse_step=2 makes only layer 1
    (of 0, 1, 2) sparse: (i + 1) % 2 == 0."""
    torch_model = tiny_qwen3_moe_model(seed=4, **changes)
    config, params = load_hf(save_tiny_hf(torch_model, tmp_path / "m"), dtype="float32")
    assert config.norm_topk_prob == changes.get("norm_topk_prob", False)
    if "decoder_sparse_step" in changes:
        assert [k[1] for k in config.layer_kinds] == ["dense", "moe", "dense"]
    tokens, mask = right_padded_batch(config.vocab_size, (11, 5))
    ours, _ = logits_and_experts(params, config, tokens, mask, XLA)
    np.testing.assert_allclose(ours[mask], transformers_logits(torch_model, tokens, mask)[mask],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("contract", [XLA, PALLAS], ids=["xla", "pallas"])
def test_qwen35_moe_logits_match_transformers(qwen35_moe, contract):
    directory, torch_model = qwen35_moe
    config, params = load_hf(directory, dtype="float32")
    assert config.model_type == "qwen3_5_moe_text" and config.shared_expert_intermediate_size
    assert config.norm_topk_prob and config.num_experts_per_tok == 3
    assert {k[1] for k in config.layer_kinds} == {"moe"}
    assert params["layers_deltanet_moe"]["shared_expert_gate"].shape == (3, 48, 1)
    tokens, mask = right_padded_batch(config.vocab_size, LENGTHS)
    ours, experts = logits_and_experts(params, config, tokens, mask, contract)
    theirs = transformers_logits(torch_model, tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)
    assert np.abs(theirs[mask]).max() > 0.5
    assert len(np.unique(experts["layers_moe"][:, mask])) == 5


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen35_moe"])
def test_save_hf_round_trip_through_transformers(family, qwen3_moe, qwen35_moe, tmp_path):
    """save_hf writes the stacked layout; transformers loads it (no missing or unexpected
    weights) to jrl's logits, and jrl reads its own save back to identical params."""
    import transformers

    directory = qwen3_moe[0] if family == "qwen3_moe" else qwen35_moe[0]
    config, params = load_hf(directory, dtype="float32")
    save_hf(tmp_path / "out", config, params, dtype="float32")
    saved = json.load(open(tmp_path / "out" / "config.json"))
    assert config_from_hf(saved) == config
    assert any(n.endswith("experts.gate_up_proj") for n in expert_tensor_names(tmp_path / "out"))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens, mask = right_padded_batch(config.vocab_size, LENGTHS)   # compiled above already
    ours, _ = logits_and_experts(params, config, tokens, mask, XLA)
    np.testing.assert_allclose(ours[mask], transformers_logits(reloaded.eval(), tokens,
                                                               mask)[mask], atol=1e-4, rtol=0)
    _, again = load_hf(tmp_path / "out", dtype="float32")
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 params, again)


def test_num_local_experts_is_read_and_a_disagreement_is_an_error(qwen3_moe):
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts, the Hub as
    num_experts: either loads; both, disagreeing, is refused naming the two fields."""
    raw = json.load(open(qwen3_moe[0] + "/config.json"))
    assert raw["num_local_experts"] == 5 and "num_experts" not in raw
    assert config_from_hf({**raw, "num_experts": 5}).num_experts == 5
    with pytest.raises(ValueError, match="num_experts=6 disagrees with num_local_experts=5"):
        config_from_hf({**raw, "num_experts": 6})
    del raw["num_local_experts"]
    with pytest.raises(ValueError, match="'num_experts' \\(or 'num_local_experts'\\)"):
        config_from_hf(raw)
