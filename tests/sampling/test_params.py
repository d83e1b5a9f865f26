"""jrl.sampling.SamplingParams and Sampler argument validation: errors name the field."""

import re

import pytest

from jrl.sampling import Sampler, SamplingParams

from .helpers import CONFIG, contract


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.0),
    ("temperature", -1.0),
    ("top_k", -1),
    ("top_k", 2.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("max_new_tokens", 0),
    ("max_new_tokens", 3.0),
    ("group_size", 0),
    ("seed", -1),
    ("seed", 2**32),
    ("stop_tokens", (1, -2)),
    ("stop_tokens", 5),
])
def test_sampling_params_error_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=re.escape(f"SamplingParams.{field}={value!r}")):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_and_replace():
    sp = SamplingParams(stop_tokens=[2, 3])
    assert sp.stop_tokens == (2, 3)  # a list becomes a tuple: the params stay hashable
    assert hash(sp) == hash(sp.replace())
    assert not sp.truncates
    assert sp.replace(top_p=0.9).truncates and sp.replace(top_k=5).truncates


@pytest.mark.parametrize("field", ["num_slots", "max_prompt_len", "steps_per_call"])
def test_sampler_shape_arguments_validated(field):
    kwargs = dict(num_slots=2, max_prompt_len=4, steps_per_call=2)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=rf"Sampler\.{field}=0"):
        Sampler(CONFIG, contract(), SamplingParams(), **kwargs)
