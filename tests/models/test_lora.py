"""jrl.models.lora and jrl.models.peft_export: attaching adapters (B = 0 gives the base model's
bits), config errors, the merged export, and PEFT directories that transformers + peft load to
jrl's logits."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.kernels.quantized import QuantizedWeight
from jrl.models import lora, load_hf, transformer
from jrl.models.config import LoraConfig, ModelConfig
from jrl.models.peft_export import (ADAPTER_CONFIG, ADAPTER_README, ADAPTER_WEIGHTS,
                                     quantized_base_note, save_peft)

from .helpers import XLA, right_padded_batch, save_tiny_hf, tiny_hf_model, transformers_logits

# hidden 64 and 4 heads x 16: every projection's input dim is a multiple of NF4's block of 64.
CONFIG = ModelConfig(vocab_size=40, hidden_size=64, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16)
# Default tiles: one tile per projection, so the Pallas programs compile quickly.
PALLAS = NumericalContract(platform="cpu")
LORA = LoraConfig(rank=4, alpha=8.0)
LENGTHS = (7, 4)


@functools.lru_cache(maxsize=None)
def _cached_base():
    # x15 (as tests/sampling/helpers.py): peaked logits, so adapter changes show clearly.
    params = transformer.init_params(CONFIG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, params)


def _base_params():
    return dict(_cached_base())


def _logits(params, config, contract, tokens, mask):
    return np.asarray(jax.jit(transformer.forward_logits, static_argnames=("config", "contract"))(
        params, config, jnp.asarray(tokens), contract=contract, mask=jnp.asarray(mask)))


def with_random_b(params, *, seed=1, scale=0.1):
    """params with every lora_b drawn from N(0, scale): an adapter that changes the model."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [scale * jax.random.normal(k, x.shape, x.dtype)
           if str(path[-1].key).endswith("_lora_b") else x
           for k, (path, x) in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def test_attach_starts_at_the_base_model_bitwise():
    base = _base_params()
    config, params = lora.attach(CONFIG, base, LORA)
    assert config.lora == LORA and config.lora.scale == 2.0        # alpha / rank = 8 / 4
    layers = params["layers"]
    # The 7 default targets, A [L, K, r] random and B [L, r, N] zero, next to their weight.
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        *lead, k, n = layers[name].shape
        assert layers[name + "_lora_a"].shape == (*lead, k, 4)
        assert layers[name + "_lora_b"].shape == (*lead, 4, n)
        assert np.all(np.asarray(layers[name + "_lora_b"]) == 0.0)
        # PEFT's init: uniform in +-1/sqrt(K).
        a = np.asarray(layers[name + "_lora_a"])
        assert 0 < np.abs(a).max() <= 1 / np.sqrt(k)
    # The base weights are the very same arrays.
    assert params["layers"]["wq"] is base["layers"]["wq"]
    assert transformer.param_shapes(config) == jax.tree.map(lambda x: tuple(x.shape), params)
    tokens, mask = right_padded_batch(CONFIG.vocab_size, LENGTHS)
    ours = _logits(params, config, PALLAS, tokens, mask)
    theirs = _logits(base, CONFIG, PALLAS, tokens, mask)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    # Not vacuous: a nonzero B moves the logits (the plain-XLA forward suffices to show it).
    moved = _logits(with_random_b(params), config, XLA, tokens, mask)
    assert np.abs(moved - theirs)[mask].max() > 0.1


def test_split_trainable_cuts_adapters_from_the_base():
    config, params = lora.attach(CONFIG, _base_params(), LoraConfig(rank=2, targets=("q_proj",)))
    trainable, frozen = lora.split_trainable(params)
    assert trainable == {"layers": {"wq_lora_a": params["layers"]["wq_lora_a"],
                                    "wq_lora_b": params["layers"]["wq_lora_b"]}}
    assert "wq" in frozen["layers"] and "embed" in frozen
    assert lora.merge_trainable(trainable, frozen).keys() == params.keys()
    assert lora.merge_trainable(trainable, frozen)["layers"].keys() == params["layers"].keys()
    # Without adapters every param trains.
    base = _base_params()
    assert lora.split_trainable(base) == (base, {})


@pytest.mark.parametrize("changes, message", [
    (dict(targets=("q_proj", "qkv")), r"model\.lora\.targets=\['q_proj', 'qkv'\]: unknown "
                                      r"\['qkv'\]; allowed: \['down_proj'"),
    (dict(targets=()), r"model\.lora\.targets=\[\]: unknown empty list"),
    (dict(targets=("q_proj", "q_proj")), r"model\.lora\.targets=.*names a target twice"),
    (dict(rank=-1), r"model\.lora\.rank=-1: must be an int >= 0"),
    (dict(rank=2.0), r"model\.lora\.rank=2\.0: must be an int >= 0"),
    (dict(alpha=0.0), r"model\.lora\.alpha=0\.0: must be a number > 0"),
    (dict(quantize="int4"), r"model\.lora\.quantize='int4': allowed values are "
                            r"\['none', 'int8', 'nf4'\]"),
    (dict(rank=0, quantize="nf4"), r"model\.lora\.quantize='nf4'.*set model\.lora\.rank > 0"),
])
def test_lora_config_errors_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**{"rank": 4, **changes})


def test_a_rank_above_a_weights_smaller_dim_is_refused():
    """CONFIG's k_proj is [64, 2 * 16 = 32]: rank 32 fits, 33 adds parameters only (the probe:
    rank 4096 on a 384-wide model, 50x the model's parameters)."""
    lora.attach(CONFIG, _base_params(), LoraConfig(rank=32, targets=("k_proj",)))
    with pytest.raises(ValueError, match=r"model\.lora\.rank=33: above min\(in, out\) = 32 of "
                                         r"the adapted weight layers\.wk \[64, 32\].*a rank of "
                                         r"at most 32"):
        lora.attach(CONFIG, _base_params(), LoraConfig(rank=33, targets=("k_proj",)))


def test_lora_target_missing_from_the_architecture_is_named():
    # A Llama has no Gated DeltaNet projections.
    with pytest.raises(ValueError, match=r"model\.lora\.targets: \['in_proj_qkv'\] not present "
                                         r"in this llama model; it has \['q_proj'"):
        transformer.param_shapes(CONFIG.replace(lora=LoraConfig(rank=4,
                                                                targets=("q_proj", "in_proj_qkv"))))
    narrow = CONFIG.replace(hidden_size=48)
    zeros = jax.tree.map(np.zeros, transformer.param_shapes(narrow),
                         is_leaf=lambda x: isinstance(x, tuple))
    with pytest.raises(ValueError, match=r"quantize='nf4': params/layers/\w+ has input dim 48, "
                                         r"not a multiple of NF4's block of 64"):
        lora.attach(narrow, zeros, LoraConfig(rank=4, quantize="nf4"))


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_merged_params_equal_the_adapted_forward(quantize):
    config, params = lora.attach(CONFIG, _base_params(), LoraConfig(rank=4, alpha=8.0,
                                                                    quantize=quantize))
    params = with_random_b(params)
    if quantize == "int8":
        assert isinstance(params["layers"]["wq"], QuantizedWeight)
    merged = lora.merged_params(config, params)
    assert not lora.has_adapters(merged)
    plain = lora.base_config(config)
    assert plain.lora is None
    tokens, mask = right_padded_batch(CONFIG.vocab_size, LENGTHS)
    adapted = _logits(params, config, XLA, tokens, mask)
    dense = _logits(jax.tree.map(jnp.asarray, merged), plain, XLA, tokens, mask)
    # The merged weight rounds W + 2 A B to float32 once where the adapted forward rounds x W
    # and (x A) B apart: float32 ulps (~1e-7 relative), amplified by two layers of x15 weights
    # to ~1e-4 at logits of ~10. The adapters themselves move the logits by > 0.1 (below).
    np.testing.assert_allclose(dense[mask], adapted[mask], rtol=0, atol=1e-3)
    # Not vacuous: the adapters matter at this size.
    base = _logits(lora.dequantized_base(params), plain, XLA, tokens, mask)
    assert np.abs(base - adapted)[mask].max() > 0.1


def test_qlora_stores_the_base_quantised():
    base = _base_params()
    config, params = lora.attach(CONFIG, base, LoraConfig(rank=4, quantize="nf4"))
    wq = params["layers"]["wq"]
    assert isinstance(wq, QuantizedWeight) and wq.shape == base["layers"]["wq"].shape
    # The embedding and norms stay float; the adapters are in the embedding's dtype.
    assert params["embed"] is base["embed"]
    assert params["layers"]["wq_lora_a"].dtype == jnp.float32
    # Projections: 4.25 bits per weight (codes + one bfloat16 absmax per 64) against 32.
    dense = sum(int(np.prod(base["layers"][n].shape)) * 4 for n in lora.QUANTIZED_WEIGHTS
                if n in base["layers"])
    stored = sum(params["layers"][n].nbytes for n in lora.QUANTIZED_WEIGHTS
                 if n in params["layers"])
    assert stored / dense == pytest.approx(4.25 / 32)


# ------------------------------------------------------------------------------------------------
# PEFT export: transformers + peft load it and give jrl's logits


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(HF directory of a tiny random untied Llama, its torch model)."""
    model = tiny_hf_model("llama_untied")
    return save_tiny_hf(model, tmp_path_factory.mktemp("llama")), model


def test_peft_export_loads_in_peft_with_jrl_logits(tiny_llama, tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    base_dir, torch_model = tiny_llama
    config, params = load_hf(base_dir, log=None)
    config, params = lora.attach(config, params, LoraConfig(rank=4, alpha=8.0,
                                                            targets="all-linear"))
    # A random too (not PEFT's init), so a transposed or mislabelled A would show.
    params = with_random_b(params, seed=2, scale=0.2)
    params["layers"] = {name: (w + jax.random.normal(jax.random.key(3), w.shape) * 0.05
                               if name.endswith("_lora_a") else w)
                        for name, w in params["layers"].items()}
    adapter_dir = os.path.join(tmp_path, "adapter")
    save_peft(adapter_dir, config, params, base_model_name_or_path=base_dir)
    assert sorted(os.listdir(adapter_dir)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]

    torch_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = peft.PeftModel.from_pretrained(torch_base, adapter_dir).eval()
    tokens, mask = right_padded_batch(config.vocab_size, (9, 5, 1))
    theirs = transformers_logits(adapted, tokens, mask)
    ours = _logits(params, config, XLA, tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], rtol=0, atol=1e-4)
    # Not vacuous: the adapters move the logits well past the tolerance.
    assert np.abs(transformers_logits(torch_model, tokens, mask) - theirs)[mask].max() > 0.1
    # All 7 Linear kinds of both layers were adapted: 2 layers x 7 x (A, B) tensors.
    from safetensors.numpy import load_file
    tensors = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    assert len(tensors) == 2 * 7 * 2
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == \
        (4, 64)


def test_save_peft_refuses_a_non_empty_directory(tmp_path):
    config, params = lora.attach(CONFIG, _base_params(), LORA)
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        save_peft(target, config, params)
    assert os.listdir(target) == ["keep.txt"] and (target / "keep.txt").read_text() == "mine"
    # No staging directory was left next to it either.
    assert os.listdir(tmp_path) == ["adapter"]
    with pytest.raises(ValueError, match="the model has no adapters"):
        save_peft(tmp_path / "other", CONFIG, _base_params())


@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_a_qlora_export_says_what_its_adapters_were_trained_against(tmp_path, quantize):
    config, params = lora.attach(CONFIG, _base_params(),
                                 dataclasses.replace(LORA, quantize=quantize))
    save_peft(tmp_path / "adapter", config, params, base_model_name_or_path="runs/base-hf")
    assert sorted(os.listdir(tmp_path / "adapter")) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_README])
    note = (tmp_path / "adapter" / ADAPTER_README).read_text()
    assert quantized_base_note(config) in note
    assert {"int8": "int8 with one float32 scale per output channel",
            "nf4": "4-bit NormalFloat"}[quantize] in note
    assert "dequantized_base" in note and "--export-hf" in note
    # A plain LoRA export has no such note.
    plain, params = lora.attach(CONFIG, _base_params(), LORA)
    assert quantized_base_note(plain) is None


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_nnx_module_holds_adapters_as_lora_params(quantize):
    from flax import nnx

    from jrl.models import from_params, params_of

    config, params = lora.attach(CONFIG, _base_params(), LoraConfig(rank=4, quantize=quantize))
    model = from_params(config, params)
    adapters, base = lora.split(params)
    # nnx.LoRAParam selects the adapters, the ecosystem's filter: 2 per target (A, B), 7 targets.
    selected = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    assert len(selected) == 14
    assert {id(x) for x in selected} == {id(x) for x in jax.tree.leaves(adapters)}
    # The module hands back the very same params pytree (a quantised base included).
    back = params_of(model)
    assert back["layers"]["wq_lora_b"] is params["layers"]["wq_lora_b"]
    assert isinstance(back["layers"]["wq"], QuantizedWeight) == (quantize == "int8")
