"""A run's samplers from its config: the rollout section's slots, prefill and speculative
decoding, with the draft model or MTP head loaded once per process for every sampler replica."""

from __future__ import annotations

import functools

from jrl.models import load_hf_mtp
from jrl.models.loading import load_weights
from jrl.models.mtp import MtpHead
from jrl.pipeline.config import RunConfig
from jrl.sampling import DraftModel, Sampler, SamplingParams, SpeculativeConfig


def build_sampler(cfg: RunConfig, model_config, sampling: SamplingParams, *,
                  cls: type[Sampler] = Sampler, **extra) -> Sampler:
    """A sampler (`cls`, given `extra` keywords too, which take precedence) of the config's
    rollout section with `sampling` (give it the task's stop ids: Task.sampling_params): KV
    recompute on weight swaps with pipeline.kv_on_swap="recompute", room for
    env.max_observation_tokens per observation in multi-turn runs, shared prefill and
    speculative decoding (n-gram drafts, or rollout.speculative.draft's model) when
    rollout.share_prefill / rollout.speculative.num_draft turn them on."""
    rollout = cfg.rollout
    options = dict(num_slots=rollout.num_slots, max_prompt_len=rollout.max_prompt_len,
                   steps_per_call=rollout.steps_per_call,
                   recompute_kv_on_swap=cfg.pipeline.kv_on_swap == "recompute",
                   max_observation_len=(cfg.env.max_observation_tokens if cfg.env.multi_turn
                                        else 0),
                   share_prefill=rollout.share_prefill,
                   prefill_buckets=rollout.prefill_buckets)
    spec = rollout.speculative
    if spec.enabled:
        draft = spec.source
        if draft == "mtp":
            draft = load_mtp_head(cfg.model.path, cfg.numerics)
        elif draft == "draft_model":
            draft = load_draft_model(spec.draft, cfg.numerics)
        options["speculative"] = SpeculativeConfig(
            draft=draft, num_draft=spec.num_draft, ngram_max=spec.ngram_max,
            draft_min_accept=spec.draft_min_accept, draft_pick=spec.draft_pick or None)
    options.update(extra)
    return cls(model_config, cfg.numerics, sampling, **options)


@functools.lru_cache(maxsize=4)
def load_draft_model(path: str, numerics) -> DraftModel:
    """rollout.speculative.draft's model, loaded once for all sampler replicas."""
    source = ("smollm2" if path == "smollm2" else "gguf" if path.endswith(".gguf") else "hf")
    config, params, _ = load_weights("rollout.speculative.draft", source, path, numerics)
    return DraftModel(config, params)


@functools.lru_cache(maxsize=4)
def load_mtp_head(path: str, numerics) -> MtpHead:
    """The MTP head of the policy checkpoint at model.path (rollout.speculative.draft='mtp'),
    loaded once for all sampler replicas."""
    _, params = load_hf_mtp(path, dtype=numerics.param_dtype)
    return MtpHead(params)
