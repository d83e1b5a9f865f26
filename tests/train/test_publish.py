"""jrl.train.publish.WeightPublisher: with LoRA the frozen base is copied to each device once;
later publishes copy the adapters alone (the bytes counted from the pytrees)."""

import jax
import jax.numpy as jnp
import numpy as np

from jrl.models import lora
from jrl.train.publish import WeightPublisher

# A tiny params tree of the LoRA layout: a base weight [16, 8] with A [16, 2] and B [2, 8].
PARAMS = {"embed": jnp.ones((10, 16)),
          "layers": {"wq": jnp.ones((16, 8)), "wq_lora_a": jnp.ones((16, 2)),
                     "wq_lora_b": jnp.zeros((2, 8))}}
# float32 bytes: base 10 * 16 * 4 + 16 * 8 * 4 = 640 + 512 = 1152; adapters
# 16 * 2 * 4 + 2 * 8 * 4 = 128 + 64 = 192.
BASE_BYTES, ADAPTER_BYTES = 1152, 192


def test_publish_sends_the_base_once_then_adapters_only():
    devices = jax.devices()[:2]
    assert lora.param_bytes(lora.split(PARAMS)[1]) == BASE_BYTES
    publish = WeightPublisher()
    first = publish(PARAMS, devices)
    assert publish.last_bytes == 2 * (BASE_BYTES + ADAPTER_BYTES)
    assert [c["layers"]["wq"].devices() for c in first] == [{d} for d in devices]
    # An update: new adapter arrays, the same base arrays.
    updated = lora.merge({"layers": {"wq_lora_b": jnp.full((2, 8), 0.5)}}, PARAMS)
    second = publish(updated, devices)
    assert publish.last_bytes == 2 * ADAPTER_BYTES
    for old, new in zip(first, second):
        assert new["layers"]["wq"] is old["layers"]["wq"]      # resident, not re-sent
        np.testing.assert_array_equal(new["layers"]["wq_lora_b"], 0.5)
    # A different base (a reloaded model) is sent again.
    reloaded = lora.merge({"embed": jnp.zeros((10, 16))}, updated)
    publish(reloaded, devices)
    assert publish.last_bytes == 2 * (BASE_BYTES + ADAPTER_BYTES)


def test_publish_without_adapters_sends_everything_every_time():
    params = {"embed": jnp.ones((10, 16)), "layers": {"wq": jnp.ones((16, 8))}}
    publish = WeightPublisher()
    for _ in range(2):
        publish(params, jax.devices()[:1])
        assert publish.last_bytes == BASE_BYTES
