"""Jitted sampler with continuous batching; records p_b, truncation floor and version per token."""

from jrl.sampling.engine import Sampler
from jrl.sampling.sample import DecodeCounts, FINISH_LENGTH, FINISH_STOP, Sample
from jrl.sampling.slots import sample_keys
from jrl.sampling.params import SamplingParams
from jrl.sampling.programs import DevicePrograms, SlotPrograms
from jrl.sampling.speculative_config import DraftModel, SpeculativeConfig
from jrl.sampling.truncation import draw_from_logits, logit_floor, sample_from_floor

__all__ = ["DecodeCounts", "DevicePrograms", "DraftModel", "FINISH_LENGTH", "FINISH_STOP",
           "Sample", "Sampler", "sample_keys", "SamplingParams", "SlotPrograms",
           "SpeculativeConfig", "draw_from_logits", "logit_floor", "sample_from_floor"]
