"""GGUF import: names, reversed dims, llama.cpp's q/k permutation, dequantization, tokenizer."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import forward_logits, load_gguf, param_shapes
from jrl.models.config import RopeScaling
from jrl.models.gguf_import import permute_llama_qk, unpermute_llama_qk
from .helpers import (SMOLLM2_TEMPLATE, XLA, byte_level_vocab, hf_state_numpy,
                      llama_cpp_permute, llama_cpp_rope_factors, right_padded_batch,
                      tiny_gguf_source_model, transformers_logits, write_tiny_gguf)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    model = tiny_gguf_source_model("llama_untied")
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model)
    return path, model


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for heads, head_dim in ((4, 16), (2, 8), (9, 64)):
        weight = rng.standard_normal((heads * head_dim, 5)).astype(np.float32)
        permuted = llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        np.testing.assert_array_equal(unpermute_llama_qk(permuted, heads), weight)
        np.testing.assert_array_equal(permute_llama_qk(weight, heads), permuted)


def test_permutation_turns_interleaved_rope_into_rotate_half():
    """Why llama.cpp permutes: its RoPE rotates adjacent pairs (x[2i], x[2i+1]); HF rotates
    (x[i], x[i + hd/2]). Row j of a permuted head is row (j % 2) * hd/2 + j // 2 of the HF head."""
    head_dim = 8
    rows = np.arange(head_dim, dtype=np.float32)[:, None]
    permuted = llama_cpp_permute(rows, 1)[:, 0]
    np.testing.assert_array_equal(permuted, [0, 4, 1, 5, 2, 6, 3, 7])


def test_llama_gguf_matches_source_weights_exactly(llama_gguf):
    path, model = llama_gguf
    config, params, _ = load_gguf(path)
    state = hf_state_numpy(model)
    assert config.model_type == "llama" and not config.tie_word_embeddings
    assert config.num_heads == 4 and config.num_kv_heads == 2 and config.head_dim == 16
    assert config.rope_theta == 5000.0 and config.rms_norm_eps == pytest.approx(1e-5)
    assert config.bos_token_id == 1 and config.eos_token_id == 2
    assert {k: v for k, v in params.items()}.keys() == param_shapes(config).keys()
    layers = params["layers"]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        for ours, theirs in [("wq", "self_attn.q_proj.weight"), ("wk", "self_attn.k_proj.weight"),
                             ("wv", "self_attn.v_proj.weight"), ("wo", "self_attn.o_proj.weight"),
                             ("w_gate", "mlp.gate_proj.weight"), ("w_up", "mlp.up_proj.weight"),
                             ("w_down", "mlp.down_proj.weight")]:
            np.testing.assert_array_equal(np.asarray(layers[ours][layer]).T,
                                          state[prefix + theirs], err_msg=ours)
        np.testing.assert_array_equal(layers["attn_norm"][layer],
                                      state[prefix + "input_layernorm.weight"])
        np.testing.assert_array_equal(layers["mlp_norm"][layer],
                                      state[prefix + "post_attention_layernorm.weight"])
    np.testing.assert_array_equal(params["embed"], state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(params["lm_head"]).T, state["lm_head.weight"])
    np.testing.assert_array_equal(params["final_norm"], state["model.norm.weight"])


def _logits_match_transformers(path, model, lengths):
    """The GGUF's logits [B, T, V] (rows of `lengths`) within 1e-4 of transformers' on `model`;
    returns (config, params, the logits)."""
    config, params, _ = load_gguf(path)
    tokens, mask = right_padded_batch(config.vocab_size, lengths)
    ours = np.asarray(forward_logits(params, config, jnp.asarray(tokens), contract=XLA,
                                     mask=jnp.asarray(mask)))
    np.testing.assert_allclose(ours[mask], transformers_logits(model, tokens, mask)[mask],
                               atol=1e-4, rtol=0)
    return config, params, ours


def test_llama_gguf_logits_match_transformers(llama_gguf):
    _logits_match_transformers(*llama_gguf, (8, 3))


# ------------------------------------------------------------------------------------------------
# Llama 3's rope_freqs


def test_a_llama3_gguf_gets_its_rope_from_rope_freqs(tmp_path):
    model = tiny_gguf_source_model("llama_rope31")
    factors = llama_cpp_rope_factors(model.config)
    # head_dim 16, theta 5000: wavelengths 2 pi 5000^(2i / 16) = 6.28 ... 1288.4 (i <= 5,
    # < 8192 / 4: divisor 1), 3736.0 (i = 6: s = (8192 / 3736.0 - 1) / 3 = 0.39757,
    # 1 / (0.60243 / 8 + 0.39757) = 2.11472) and 10833.7 (i = 7, > 8192: divisor 8).
    np.testing.assert_allclose(factors, [1, 1, 1, 1, 1, 1, 2.11472, 8], rtol=1e-5)
    path = write_tiny_gguf(tmp_path / "llama31.gguf", model, rope_freqs=factors)
    config, params, ours = _logits_match_transformers(path, model, (120, 7))
    assert config.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0,
                                              original_max_position_embeddings=8192)
    tokens, mask = right_padded_batch(config.vocab_size, (120, 7))
    unscaled = np.asarray(forward_logits(params, config.replace(rope_scaling=None),
                                         jnp.asarray(tokens), contract=XLA,
                                         mask=jnp.asarray(mask)))
    # Without the divisors the logits leave the 1e-4 the comparison allows.
    assert np.abs(ours[mask] - unscaled[mask]).max() > 1e-3


def test_the_original_context_comes_from_the_metadata(tmp_path):
    # llama_rope3's L = 32 puts the tiny model's wavelengths in all three bands.
    model = tiny_gguf_source_model("llama_rope3")
    path = write_tiny_gguf(tmp_path / "m.gguf", model,
                           rope_freqs=llama_cpp_rope_factors(model.config),
                           extra_metadata={"llama.rope.scaling.original_context_length": 32})
    config, _, _ = _logits_match_transformers(path, model, (9, 5))
    assert config.rope_scaling.original_max_position_embeddings == 32


def test_divisors_of_one_are_unscaled_rope(tmp_path):
    model = tiny_gguf_source_model("llama")
    path = write_tiny_gguf(tmp_path / "m.gguf", model, rope_freqs=np.ones(8, np.float32))
    assert load_gguf(path)[0].rope_scaling is None


@pytest.mark.parametrize("kind, change, message", [
    ("llama_rope31", lambda f: f * np.asarray([1] * 6 + [1.5, 1], np.float32),
     r"rope_freqs\.weight = \[.*\] is not Llama 3's RoPE scaling with factor=8\.0"),
    ("llama_rope31", lambda f: f[:4], r"rope_freqs\.weight has shape \[4\]; expected \[8\]"),
    ("llama_rope31", lambda f: f * 0.5, r"rope_freqs\.weight = .*: divisors must be finite and "
                                        r">= 1"),
    ("qwen3", lambda f: np.ones(16, np.float32),
     r"rope_freqs\.weight is Llama 3's RoPE scaling; jrl reads it only for the llama "
     r"architecture, not 'qwen3'"),
])
def test_rope_freqs_jrl_cannot_express_is_one_error_naming_it(tmp_path, kind, change, message):
    model = tiny_gguf_source_model(kind)
    factors = llama_cpp_rope_factors(model.config) if kind != "qwen3" else None
    path = write_tiny_gguf(tmp_path / "m.gguf", model, arch=kind.split("_")[0],
                           rope_freqs=change(factors))
    with pytest.raises(ValueError, match=message):
        load_gguf(path)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_gguf_is_not_permuted(tmp_path, kind):
    model = tiny_gguf_source_model(kind)
    path = write_tiny_gguf(tmp_path / f"{kind}.gguf", model, arch=kind)
    config, params, _ = load_gguf(path)
    state = hf_state_numpy(model)
    assert config.model_type == kind
    assert config.attention_bias == (kind == "qwen2") and config.qk_norm == (kind == "qwen3")
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][1]).T,
                                  state["model.layers.1.self_attn.q_proj.weight"])
    if kind == "qwen2":
        np.testing.assert_array_equal(params["layers"]["bk"][0],
                                      state["model.layers.0.self_attn.k_proj.bias"])
    else:
        np.testing.assert_array_equal(params["layers"]["k_norm"][0],
                                      state["model.layers.0.self_attn.k_norm.weight"])
    tokens, mask = right_padded_batch(config.vocab_size, (7, 4))
    ours = np.asarray(forward_logits(params, config, jnp.asarray(tokens), contract=XLA,
                                     mask=jnp.asarray(mask)))
    np.testing.assert_allclose(ours[mask], transformers_logits(model, tokens, mask)[mask],
                               atol=1e-4, rtol=0)


def test_quantized_tensors_are_dequantized(tmp_path):
    model = tiny_gguf_source_model("llama")
    qtypes = {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q8_0,
              "blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q8_0,
              "blk.0.ffn_down.weight": gguf.GGMLQuantizationType.F16}
    path = write_tiny_gguf(tmp_path / "q.gguf", model, quantize=qtypes)
    config, params, _ = load_gguf(path)
    state = hf_state_numpy(model)

    def roundtrip(array, qtype):
        return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)

    q_hf = state["model.layers.0.self_attn.q_proj.weight"]
    expected_q = unpermute_llama_qk(roundtrip(llama_cpp_permute(q_hf, 4),
                                              gguf.GGMLQuantizationType.Q8_0), 4)
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][0]).T, expected_q)
    assert 0 < np.abs(expected_q - q_hf).max() < 0.01  # really quantized, and close
    np.testing.assert_array_equal(
        np.asarray(params["layers"]["w_up"][1]).T,
        roundtrip(state["model.layers.1.mlp.up_proj.weight"], gguf.GGMLQuantizationType.Q8_0))
    np.testing.assert_array_equal(
        np.asarray(params["layers"]["w_down"][0]).T,
        state["model.layers.0.mlp.down_proj.weight"].astype(np.float16).astype(np.float32))
    assert config.tie_word_embeddings and "lm_head" not in params


def test_load_gguf_casts_to_dtype(llama_gguf):
    _, params, _ = load_gguf(llama_gguf[0], dtype=jnp.bfloat16)
    assert params["layers"]["wq"].dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------------
# tokenizer from metadata


def test_gguf_tokenizer_round_trips_text(llama_gguf):
    _, _, tokenizer = load_gguf(llama_gguf[0])
    tokens, _, _ = byte_level_vocab()
    assert tokenizer.vocab_size == len(tokens)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 2)
    assert tokenizer.stop_ids == (2,)
    for text in ["Hello world", "the cat in the hat 12+34=46", "naïve café ✓ 日本",
                 "  spaces\n\nand\ttabs  ", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode("Hello world")
    assert [tokenizer.backend.id_to_token(i) for i in ids] == ["Hello", "Ġworld"]
    # smollm pre-tokenizer: digits are split one by one before BPE.
    assert [tokenizer.backend.id_to_token(i) for i in tokenizer.encode("123")] == ["1", "2", "3"]
    # Control tokens written in text are single special tokens.
    assert tokenizer.encode("<|im_start|>user") == [1] + tokenizer.encode("user")
    assert tokenizer.decode([1, *tokenizer.encode("hi"), 2], skip_special_tokens=True) == "hi"


def test_gguf_tokenizer_chat_template(llama_gguf):
    _, _, tokenizer = load_gguf(llama_gguf[0])
    assert tokenizer.chat_template == SMOLLM2_TEMPLATE
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                      "by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------------
# malformed files


def test_missing_gguf_tensor_is_named(tmp_path):
    model = tiny_gguf_source_model("llama")
    path = write_tiny_gguf(tmp_path / "m.gguf", model, drop=("blk.1.ffn_gate.weight",))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) blk\.1\.ffn_gate\.weight"):
        load_gguf(path)


def test_unsupported_gguf_architecture(tmp_path):
    model = tiny_gguf_source_model("llama")
    path = write_tiny_gguf(tmp_path / "m.gguf", model, arch="gemma")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma'.*'llama'"):
        load_gguf(path)


def test_scaled_rope_gguf_is_rejected(tmp_path):
    model = tiny_gguf_source_model("llama")
    path = write_tiny_gguf(tmp_path / "m.gguf", model,
                           extra_metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        load_gguf(path)


def test_unknown_pre_tokenizer_is_rejected(tmp_path):
    model = tiny_gguf_source_model("llama")
    path = write_tiny_gguf(tmp_path / "m.gguf", model, pre="chatglm-bpe")
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre='chatglm-bpe'"):
        load_gguf(path)


@pytest.mark.parametrize("contents", [b"\x00" * 64, b"GGUF" + b"\xff" * 60])
def test_a_file_that_is_not_gguf_names_the_path(tmp_path, contents):
    path = tmp_path / "broken.gguf"
    path.write_bytes(contents)
    with pytest.raises(ValueError, match=f"GGUF file '{path}' cannot be read"):
        load_gguf(path)
