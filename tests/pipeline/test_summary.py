"""The model card an exported policy carries (jrl.pipeline.loop.summary.model_card), and
export_hf writing it beside the weights. summary.json itself: tests/pipeline/test_run.py."""

import json

import jax

from jrl.cli.convert import export_hf
from jrl.models import transformer
from jrl.pipeline.loop.summary import model_card
from tests.pipeline.test_fast_rollout_run import _NoTokenizerFiles
from tests.pipeline.tiny import tiny_config

SUMMARY = {
    "name": "gsm8k_qwen3_sync", "steps": 120, "wall_s": 3600.0,
    "first_eval": {"step": 0, "eval/accuracy": 0.5, "eval/accuracy_greedy": 0.5},
    "last_eval": {"step": 120, "eval/accuracy": 0.75, "eval/accuracy_greedy": 0.75},
    "best_eval": {"step": 100, "eval/accuracy": 0.8125, "eval/accuracy_greedy": 0.8125},
    "recipe": "Recipe(grpo: ...)",
    "contract": {"backend": "pallas", "compute_dtype": "bfloat16", "param_dtype": "float32"},
    "model": {"source": "hf", "path": "/data/Qwen3-0.6B", "model_type": "qwen3"},
}


def test_the_card_names_the_base_the_recipe_and_the_evaluation():
    card = model_card(SUMMARY, model_type="qwen3", base_model="/data/Qwen3-0.6B/")
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "base_model: Qwen3-0.6B\n" in card            # the directory's name, not the path
    assert "- RL steps: 120" in card and "- recipe: `Recipe(grpo: ...)`" in card
    assert "backend pallas, compute bfloat16, params float32" in card
    rows = [line for line in card.splitlines() if line.startswith("| ")]
    assert rows[0] == "| | step | eval/accuracy | eval/accuracy_greedy |"
    assert rows[1:] == ["| first | 0 | 0.5 | 0.5 |", "| best | 100 | 0.8125 | 0.8125 |",
                        "| last | 120 | 0.75 | 0.75 |"]
    # A run without evaluation has no table, and a random init no base_model line.
    bare = model_card({**SUMMARY, "first_eval": None, "last_eval": None, "best_eval": None},
                      model_type="llama", base_model=None)
    assert "## Evaluation" not in bare and "base_model" not in bare
    assert "a random initialisation" in bare


def test_export_hf_writes_the_card_beside_the_weights(tmp_path):
    config = tiny_config().model.arch
    export_hf(str(tmp_path / "export"), config, transformer.init_params(config,
                                                                       jax.random.key(0)),
              _NoTokenizerFiles(), model_card=model_card(SUMMARY, model_type="llama", base_model=None))
    card = (tmp_path / "export" / "README.md").read_text()
    assert "| best | 100 | 0.8125 | 0.8125 |" in card
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "llama"
