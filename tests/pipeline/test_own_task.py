"""A user's own task from the config alone: their jsonl (own field names, an extra field the
reward reads), their reward module (a file, named parts with weights, token ids), and a
transformers-made Qwen3 checkpoint; one step, in the synchronous and the asynchronous loop."""

import json
import textwrap

import numpy as np
import pytest

from jrl.pipeline.loop.runner import Run
from tests.models.helpers import save_tiny_hf, tiny_hf_model
from tests.pipeline.tiny import tiny_config

RECORDS = [{"problem": f"{a}+{b}", "target": a + b, "unit": "apples"}
           for a, b in ((1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (7, 0))]

# The reward reads the record's extra field and the response's token ids, and writes what it
# was given, so the test can check that the run called it with them.
REWARD_MODULE = textwrap.dedent('''
    import json, os

    def reward(response, example, token_ids):
        with open(os.environ["JRL_TEST_REWARD_LOG"], "a") as log:
            log.write(json.dumps({"unit": example.meta["record"]["unit"],
                                  "answer": example.answer, "ids": list(token_ids),
                                  "response": response}) + "\\n")
        return {"correct": float(response.strip() == example.answer),
                "length": len(token_ids) / 8}
''')


@pytest.fixture(scope="module")
def own_task(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own_task")
    data = tmp / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp / "my_reward.py").write_text(REWARD_MODULE)
    checkpoint = save_tiny_hf(tiny_hf_model("qwen3"), tmp / "qwen3")
    return tmp, data, checkpoint


@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async"])
def test_a_run_with_its_own_data_fields_and_reward_module(own_task, staleness, monkeypatch):
    tmp, data, checkpoint = own_task
    reward_log = tmp / f"calls{staleness}.jsonl"
    monkeypatch.setenv("JRL_TEST_REWARD_LOG", str(reward_log))
    config = tiny_config(
        "model.source=hf", f"model.path={checkpoint}", "model.tokenizer=char",
        "data.source=file", f"data.path={data}", "data.prompt_field=problem",
        "data.answer_field=target", "data.train_size=6",
        f"rollout.reward_fn={tmp / 'my_reward.py'}:reward",
        'rollout.reward_weights=length=0.5', "train.steps=1", "train.sft_steps=0",
        f"pipeline.max_staleness={staleness}", "checkpoint.every=0")
    run = Run(config, str(tmp / f"run{staleness}"), log=lambda *_: None)
    first = run.parts.train_examples[0]
    assert (first.question, first.answer) == ("1+2", "3")      # the JSON number 3, as text
    run.run()
    record = run.history[-1]
    calls = [json.loads(line) for line in reward_log.read_text().splitlines()]
    # 4 prompts x 4 samples, each scored once with its record's extra field and its tokens.
    assert len(calls) == 16 and {c["unit"] for c in calls} == {"apples"}
    assert all(run.task.decode_tokens(c["ids"]) == c["response"] for c in calls)
    correct = np.mean([c["response"].strip() == c["answer"] for c in calls])
    length = np.mean([len(c["ids"]) / 8 for c in calls])
    assert length > 0                    # so the weight below shows in the reward
    assert record["rollout/reward_part/correct"] == pytest.approx(correct)
    assert record["rollout/reward_part/length"] == pytest.approx(length)
    # reward = correct + 0.5 * length, row by row, so the means obey the same sum.
    assert record["rollout/reward_mean"] == pytest.approx(correct + 0.5 * length, abs=1e-6)
    assert record["rollout/reward_errors"] == 0
    assert record["mismatch/logprob_abs_diff_max"] == 0.0
    # config.json keeps the user's task for a resume.
    saved = json.loads((tmp / f"run{staleness}" / "config.json").read_text())
    assert saved["rollout"]["reward_fn"].endswith("my_reward.py:reward")
    assert saved["data"]["prompt_field"] == "problem"


def test_a_warm_start_without_solutions_names_the_record_and_the_keys(own_task):
    tmp, data, checkpoint = own_task
    config = tiny_config(
        "model.source=hf", f"model.path={checkpoint}", "model.tokenizer=char",
        "data.source=file", f"data.path={data}", "data.prompt_field=problem",
        "data.answer_field=target", "data.train_size=6", "train.sft_steps=1")
    run = Run(config, str(tmp / "sft"), log=lambda *_: None)
    with pytest.raises(ValueError, match=(
            r"train\.sft_steps=1 needs a worked solution for every training example, and "
            r".*mine\.jsonl:\d has none: name the record field that holds one "
            r"\(data\.solution_field\) or set train\.sft_steps=0")):
        run.run()
