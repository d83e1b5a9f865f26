"""HF checkpoint I/O: logits vs transformers, layouts, bf16, sharding, round trips, bad inputs."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.models import (config_from_hf, config_to_hf, forward_logits, load, load_hf,
                        param_shapes, save_hf)
from jrl.models import hf_checkpoint, hf_config
from jrl.models.config import ModelConfig
from jrl.models.safetensors_io import SafetensorsFile, write_safetensors
from .helpers import (TINY_HF, XLA, right_padded_batch, save_tiny_hf,
                                 tiny_hf_model, transformers_logits)

LENGTHS = (9, 5, 1)


def _bits(array) -> np.ndarray:
    """The raw bits of an array, so equality is bitwise (NaN-safe, -0.0 != 0.0)."""
    array = np.asarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def assert_trees_bitwise_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype, (path, x.dtype, y.dtype)
        assert x.shape == y.shape, (path, x.shape, y.shape)
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=str(path))


def shapes_of(params):
    return jax.tree_util.tree_map(lambda x: tuple(x.shape), params)


# ------------------------------------------------------------------------------------------------
# logits against transformers


@pytest.mark.parametrize("kind", sorted(TINY_HF))
def test_logits_match_transformers(tiny_hf_checkpoints, kind):
    directory, torch_model = tiny_hf_checkpoints[kind]
    model = load(directory, contract=XLA)
    assert shapes_of(model.params) == param_shapes(model.config)
    tokens, mask = right_padded_batch(model.config.vocab_size, LENGTHS)
    ours = np.asarray(model(tokens, mask=mask))
    theirs = transformers_logits(torch_model, tokens, mask)
    assert ours.shape == theirs.shape == (len(LENGTHS), max(LENGTHS), model.config.vocab_size)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)
    # The logits are far from uniform, so the comparison above is not vacuous.
    assert np.abs(theirs[mask]).max() > 0.5


def test_config_features_per_family(tiny_hf_checkpoints):
    configs = {kind: load_hf(tiny_hf_checkpoints[kind][0])[0] for kind in TINY_HF}
    assert configs["llama"].tie_word_embeddings and not configs["llama_untied"].tie_word_embeddings
    assert configs["qwen2"].attention_bias and not configs["qwen2"].qk_norm
    assert configs["qwen3"].qk_norm and not configs["qwen3"].attention_bias
    assert configs["qwen3"].head_dim == 32 != configs["qwen3"].hidden_size // 4
    assert configs["llama"].rope_theta == 5000.0
    assert configs["llama"].rms_norm_eps == 1e-5


def test_pallas_backend_matches_transformers(tiny_hf_checkpoints):
    directory, torch_model = tiny_hf_checkpoints["qwen3"]
    model = load(directory, contract=NumericalContract(backend="pallas"))
    tokens, mask = right_padded_batch(model.config.vocab_size, (6, 3))
    ours = np.asarray(model(tokens, mask=mask))
    theirs = transformers_logits(torch_model, tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------
# storage variants


def test_sharded_index_loads_like_single_file(tiny_hf_checkpoints, tmp_path):
    directory, torch_model = tiny_hf_checkpoints["qwen2"]
    sharded = save_tiny_hf(torch_model, tmp_path / "sharded", max_shard_size="40KB")
    files = os.listdir(sharded)
    assert hf_checkpoint.INDEX_FILE in files
    assert sum(name.endswith(".safetensors") for name in files) > 2
    assert_trees_bitwise_equal(load_hf(sharded)[1], load_hf(directory)[1])


def test_bfloat16_checkpoint_loads_bitwise(tmp_path):
    import torch

    torch_model = tiny_hf_model("qwen2", seed=3).to(torch.bfloat16)
    directory = save_tiny_hf(torch_model, tmp_path / "bf16")
    config, params = load_hf(directory)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(params))
    expected = torch_model.model.layers[1].self_attn.q_proj.weight.detach()
    expected_bits = expected.view(torch.int16).numpy().astype(np.uint16)
    np.testing.assert_array_equal(_bits(params["layers"]["wq"][1]).T, expected_bits)
    # Up-casting on load is exact.
    _, params32 = load_hf(directory, dtype="float32")
    np.testing.assert_array_equal(np.asarray(params32["embed"]),
                                  np.asarray(params["embed"]).astype(np.float32))
    # The bf16 weights, run in float32, match transformers loading the same file in float32
    # (a fresh load: casting the bf16 torch model back would keep its bf16-rounded RoPE buffer).
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokens, mask = right_padded_batch(config.vocab_size, (7, 4))
    ours = np.asarray(forward_logits(params32, config, jnp.asarray(tokens), contract=XLA,
                                     mask=jnp.asarray(mask)))
    theirs = transformers_logits(reference.eval(), tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bitwise(tiny_hf_checkpoints, tmp_path, kind, dtype):
    config, params = load_hf(tiny_hf_checkpoints[kind][0], dtype=dtype)
    save_hf(tmp_path / "once", config, params, dtype=dtype)
    config_again, params_again = load_hf(tmp_path / "once")
    assert config_again == config
    assert_trees_bitwise_equal(params_again, params)
    # A second save of the reloaded params writes the same bytes.
    save_hf(tmp_path / "twice", config_again, params_again, dtype=dtype)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "once" / name).read_bytes() == (tmp_path / "twice" / name).read_bytes()


def test_save_shards_with_index_and_round_trips(tiny_hf_checkpoints, tmp_path):
    config, params = load_hf(tiny_hf_checkpoints["qwen2"][0])
    save_hf(tmp_path / "out", config, params, dtype="float32", max_shard_bytes=64 * 1024)
    files = sorted(os.listdir(tmp_path / "out"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert hf_checkpoint.INDEX_FILE in files and "model.safetensors" not in files
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / hf_checkpoint.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert_trees_bitwise_equal(load_hf(tmp_path / "out")[1], params)


def test_saved_checkpoint_loads_in_transformers(tiny_hf_checkpoints, tmp_path):
    import torch
    import transformers

    for kind in ("llama", "qwen2", "qwen3"):
        directory, torch_model = tiny_hf_checkpoints[kind]
        config, params = load_hf(directory)
        save_hf(tmp_path / kind, config, params, dtype="float32")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / kind, dtype=torch.float32).eval()
        assert type(reloaded) is type(torch_model)
        tokens, mask = right_padded_batch(config.vocab_size, (6, 2))
        np.testing.assert_array_equal(transformers_logits(reloaded, tokens, mask),
                                      transformers_logits(torch_model, tokens, mask))


def test_save_is_atomic(tiny_hf_checkpoints, tmp_path, monkeypatch):
    config, params = load_hf(tiny_hf_checkpoints["llama"][0])
    target = tmp_path / "ckpt"
    save_hf(target, config, params, dtype="float32")
    before = {name: (target / name).read_bytes() for name in os.listdir(target)}

    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf(target, config, params, dtype="bfloat16")

    calls = []

    def failing_write(path, tensors, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        write_safetensors(path, tensors, **kwargs)

    monkeypatch.setattr(hf_checkpoint, "write_safetensors", failing_write)
    with pytest.raises(OSError, match="simulated"):
        save_hf(target, config, params, dtype="float32", overwrite=True, max_shard_bytes=40_000)
    # The old checkpoint is untouched and no partial directory is left behind.
    assert {name: (target / name).read_bytes() for name in os.listdir(target)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    with pytest.raises(OSError, match="simulated"):
        calls.clear()
        save_hf(tmp_path / "fresh", config, params, dtype="float32", max_shard_bytes=40_000)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]

    monkeypatch.undo()
    save_hf(target, config, params, dtype="bfloat16", overwrite=True)
    assert load_hf(target)[1]["embed"].dtype == jnp.bfloat16
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_rejects_params_that_do_not_fit_the_config(tiny_hf_checkpoints, tmp_path):
    config, params = load_hf(tiny_hf_checkpoints["llama"][0])
    bad = dict(params, layers=dict(params["layers"], wq=params["layers"]["wq"][:, :, :8]))
    with pytest.raises(ValueError, match=r"params/layers/wq has shape \[2, 64, 8\], expected "
                                         r"\[2, 64, 64\]"):
        save_hf(tmp_path / "bad", config, bad, dtype="float32")
    with pytest.raises(ValueError, match="unexpected entries.*lm_head"):
        save_hf(tmp_path / "bad", config, dict(params, lm_head=params["embed"].T),
                dtype="float32")
    assert not os.path.exists(tmp_path / "bad")


# ------------------------------------------------------------------------------------------------
# config.json


def _llama_json(**changes):
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "rope_theta": 5000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def test_config_from_hf_reads_both_rope_styles_and_dtype_keys():
    top = config_from_hf(_llama_json())
    nested = config_from_hf(_llama_json(rope_theta=..., torch_dtype=..., dtype="float32",
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 5000.0}))
    assert top == nested
    assert top.rope_theta == 5000.0 and top.head_dim == 16  # 64 hidden / 4 heads
    assert config_from_hf(_llama_json(rope_scaling=None)).rope_theta == 5000.0
    assert hf_config.hf_dtype(_llama_json()) == "bfloat16"
    assert config_from_hf(_llama_json(eos_token_id=[2, 7])).eos_token_id == (2, 7)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_config_to_hf_round_trips(model_type):
    config = ModelConfig(model_type=model_type, vocab_size=100, hidden_size=32,
                         intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=1,
                         head_dim=24, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=model_type != "qwen2",
                         attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
                         max_position_embeddings=512, bos_token_id=None, eos_token_id=(2, 3))
    hf = config_to_hf(config, jnp.bfloat16)
    assert hf["torch_dtype"] == hf["dtype"] == "bfloat16"
    assert config_from_hf(json.loads(json.dumps(hf))) == config


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "rope_scaling of rope_type 'llama3' lacks 'low_freq_factor'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "unsupported rope_scaling type 'linear'"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     r"unsupported rope_scaling type 'longrope' \(in rope_parameters\.rope_type\); allowed: "
     r"'default' \(unscaled\), 'llama3', 'yarn'$"),
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]),
     r"unsupported model_type 'mistral'.*supported: \['llama', 'qwen2', 'qwen3', 'qwen3_5_moe_text', "
     r"'qwen3_5_text', 'qwen3_moe', 'qwen3_5', 'qwen3_5_moe'\]"),
    (dict(architectures=["LlamaForSequenceClassification"]),
     "architecture 'LlamaForSequenceClassification' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=true.*o_proj"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_size=...), "'hidden_size' is missing"),
    (dict(torch_dtype="int8"), "dtype 'int8' is not supported"),
    (dict(rope_theta=5000.0, rope_parameters={"rope_type": "default", "rope_theta": 10.0}),
     "disagrees"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
])
def test_config_from_hf_rejects_unsupported(changes, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(_llama_json(**changes))


def test_qwen3_attention_bias_is_rejected_with_reason():
    qwen3 = _llama_json(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
                        attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias=true for model_type 'qwen3'.*o_proj"):
        config_from_hf(qwen3)


# ------------------------------------------------------------------------------------------------
# malformed checkpoints


def _rewrite_tensors(directory, edit):
    """Rewrites model.safetensors in `directory` with edit(dict name -> array)."""
    path = os.path.join(directory, "model.safetensors")
    source = SafetensorsFile(path)
    tensors = {name: np.array(source.read(name)) for name in source.names()}
    del source
    write_safetensors(path, edit(tensors), metadata={"format": "pt"})


@pytest.fixture
def llama_copy(tiny_hf_checkpoints, tmp_path):
    directory, torch_model = tiny_hf_checkpoints["llama_untied"]
    return save_tiny_hf(torch_model, tmp_path / "copy")


def test_missing_tensor_is_named(llama_copy):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_tensors(llama_copy, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=rf"missing tensor\(s\) {name}"):
        load_hf(llama_copy)


def test_wrong_shape_names_tensor_expected_and_found(llama_copy):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_tensors(llama_copy, lambda t: {**t, name: t[name][:16]})
    with pytest.raises(ValueError, match=rf"tensor {name} has shape \[16, 64\], expected "
                                         r"\[32, 64\]"):
        load_hf(llama_copy)


def test_a_non_finite_weight_is_refused_naming_the_tensor(llama_copy):
    """A NaN weight once loaded, and every step's loss was NaN (the stop message then blamed
    the learning rate)."""
    name = "model.layers.1.self_attn.v_proj.weight"

    def poison(tensors):
        w = tensors[name].copy()
        w[3, 5], w[0, 0] = np.nan, np.inf
        return {**tensors, name: w}

    _rewrite_tensors(llama_copy, poison)
    with pytest.raises(ValueError, match=rf"tensor {name} holds 2 NaN or infinite value\(s\) "
                                         rf"of {32 * 64}; the checkpoint is corrupt"):
        load_hf(llama_copy)


def test_an_integer_weight_is_refused_not_cast(llama_copy):
    """An int32 tensor (an MoE router's, in the probe) was cast to float and trained on."""
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite_tensors(llama_copy, lambda t: {**t, name: np.ones(t[name].shape, np.int32)})
    with pytest.raises(ValueError, match=rf"tensor {name} holds int32 values; a model's weights "
                                         "are floating point"):
        load_hf(llama_copy)


def test_unexpected_tensor_is_rejected(llama_copy):
    _rewrite_tensors(llama_copy, lambda t: {**t, "model.layers.0.self_attn.o_proj.bias":
                                            np.zeros(64, np.float32)})
    with pytest.raises(ValueError, match="unexpected tensor.*o_proj.bias"):
        load_hf(llama_copy)


def test_tied_checkpoint_with_different_lm_head_is_rejected(tiny_hf_checkpoints, tmp_path):
    directory = save_tiny_hf(tiny_hf_checkpoints["llama"][1], tmp_path / "tied")
    _rewrite_tensors(directory, lambda t: {**t, "lm_head.weight":
                                           t["model.embed_tokens.weight"] + 1.0})
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_hf(directory)


def test_bad_directories_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_llama_json()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match="truncated"):
        load_hf(tmp_path)


def test_safetensors_bf16_bytes_match_reference_writer(tmp_path):
    """Our writer produces files the reference safetensors library reads (and vice versa)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"w": weights}, tmp_path / "ref.safetensors")
    ours = SafetensorsFile(tmp_path / "ref.safetensors").read("w")
    assert ours.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(_bits(ours), weights.view(torch.int16).numpy().view(np.uint16))
    write_safetensors(tmp_path / "ours.safetensors", {"w": np.array(ours)})
    assert torch.equal(load_file(tmp_path / "ours.safetensors")["w"], weights)


@pytest.mark.parametrize("text, message", [("{not json", "not valid JSON"),
                                           ("[1, 2]", "expected a JSON object, got list")])
def test_a_broken_config_json_names_the_file(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"{tmp_path}/config.json: {message}"):
        load_hf(tmp_path)
