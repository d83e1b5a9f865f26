"""A run's trained policy exported with `jrl.cli.train --export-hf` loads in transformers, which
gives jrl's logits for the trained weights and generates with them. Slow: one RL step of the
real SmolLM2-135M checkpoint on a CPU."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow

TINY_RUN = ["--set", "train.steps=1", "--set", "rollout.prompts_per_step=2",
            "--set", "sampling.group_size=2", "--set", "sampling.max_new_tokens=16",
            "--set", "data.eval_size=0", "--set", "checkpoint.every=0",
            "--set", "optimizer.learning_rate=1e-4", "--set", "optimizer.warmup_steps=0",
            # A gradient even when every reward of the tiny rollout is equal (zero advantages).
            "--set", "algorithm.entropy_coef=0.01"]


def test_exported_policy_loads_in_transformers_with_jrl_logits(tmp_path):
    import jax
    import torch
    import transformers

    from jrl.kernels.contract import NumericalContract
    from jrl.models import forward_logits, load_gguf, smollm2_gguf_path
    from jrl.cli import train

    out, dump = tmp_path / "policy-hf", tmp_path / "params.npz"
    rc = train.main(["--config", "jrl/configs/smollm2_arith.py", "--workdir", str(tmp_path / "run"),
                     "--export-hf", str(out), "--dump-params", str(dump)] + TINY_RUN)
    assert rc == 0
    config, base, tokenizer = load_gguf(smollm2_gguf_path())
    flat = np.load(dump)
    trained = jax.tree_util.tree_map_with_path(
        lambda path, _: flat[jax.tree_util.keystr(path)], base)
    # One update at lr 1e-4 moved the weights: the export is the trained policy, not the base.
    assert not np.array_equal(trained["layers"]["wq"], np.asarray(base["layers"]["wq"]))

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 plus 5?"}], add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    ours = np.asarray(forward_logits(trained, config, np.asarray([ids], np.int32),
                                     contract=NumericalContract(backend="xla")))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
        generated = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                                   pad_token_id=tokenizer.pad_id)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert generated.shape[1] > len(ids)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer(prompt, add_special_tokens=False).input_ids == ids
