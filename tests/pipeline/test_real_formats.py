"""The real-data path end to end: GSM8K-format jsonl, a GGUF checkpoint with its own byte-level
tokenizer and ChatML template (the SmolLM2 / Qwen layout), SFT on GSM8K solutions, one RL step."""

import json

import numpy as np

from jrl.pipeline.loop.runner import Run
from tests.models.helpers import tiny_gguf_source_model, write_tiny_gguf
from tests.pipeline.tiny import tiny_config

RECORDS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?",
     "answer": "Tom has 3+4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "Ann had 10 pens and gave away 4. How many are left?",
     "answer": "10-4 = <<10-4=6>>6\n#### 6"},
    {"question": "A box holds 2 rows of 5 eggs. How many eggs?",
     "answer": "2*5 = <<2*5=10>>10\n#### 10"},
    {"question": "Sam reads 1,000 pages, then 234 more. Total?",
     "answer": "1000+234 = <<1000+234=1234>>1,234\n#### 1,234"},
]


def test_gsm8k_jsonl_with_gguf_checkpoint_and_chat_template(tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_gguf_source_model("llama"))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    config = tiny_config(
        "model.source=gguf", f"model.path={gguf_path}", "model.tokenizer=model",
        "data.source=gsm8k_jsonl", f"data.path={data}", f"data.eval_path={data}",
        "data.template=chat", "data.train_size=4", "data.eval_size=2",
        "rollout.max_prompt_len=192", "train.steps=1", "train.sft_steps=1",
        "train.sft_batch_size=4", "eval.greedy=true")
    run = Run(config, str(tmp_path / "run"), log=lambda *_: None)
    assert run.task.tokenizer.apply_chat_template  # the checkpoint's own tokenizer
    prompt = run.task.render(run.parts.train_examples[0])
    text = run.task.tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert "Tom has 3 apples" in text
    assert run.parts.train_examples[3].answer == "1234"   # "#### 1,234" normalised
    result = run.run()
    record = run.history[-1]
    assert np.isfinite(record["train/loss"])
    assert record["mismatch/logprob_abs_diff_max"] == 0.0
    assert 0.0 <= result.final_eval["eval/accuracy"] <= 1.0
