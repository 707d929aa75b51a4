"""Model health: the four figures of int8 values, per parameter slice and activation."""

import math

import numpy as np
import pytest

from deggs.config import Config
from deggs.numerics.health import Stats, activation_health, int8_stats, weight_health
from deggs.numerics.model import init_overlays, init_params
from deggs.numerics.params import HEALTH_ACTIVATIONS, health_entries

CFG = Config().replace(model=dict(hidden_dim=32, head_dim=32, n_layers=2, vocab_size=256))


def test_figures_worked_out_by_hand():
    # -128 once, 127 twice, 0 once: mean 126/4; three of four at or past +-127; p = 1/4,
    # 1/2, 1/4 gives 1.5 bits; deviations -159.5, 95.5, 95.5, -31.5.
    s = int8_stats(np.array([-128, 127, 127, 0], np.int8))
    assert s.mean == 31.5
    assert s.std == pytest.approx(math.sqrt((159.5**2 + 2 * 95.5**2 + 31.5**2) / 4), abs=1e-12)
    assert (s.saturation, s.entropy) == (0.75, 1.5)
    assert int8_stats(np.full((3, 5), 16, np.int8)) == Stats(16.0, 0.0, 0.0, 0.0)
    assert int8_stats(np.array([-127, 127])) == Stats(0.0, 127.0, 1.0, 1.0)  # any int dtype


def test_every_value_once_is_eight_bits():
    s = int8_stats(np.arange(-128, 128).astype(np.int8))
    assert s.mean == -0.5 and s.entropy == 8.0 and s.saturation == 3 / 256
    assert s.std == pytest.approx(math.sqrt((256**2 - 1) / 12), abs=1e-12)  # discrete uniform


@pytest.mark.parametrize(
    "values, message",
    [
        (np.zeros(0, np.int8), "no values"),
        (np.array([0.5]), "int8 integers"),
        (np.array([128]), r"in \[128, 128\]"),
        (np.array([-129, 0]), "int8 integers"),
    ],
)
def test_values_that_are_not_int8_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        int8_stats(values)


def test_each_layers_copy_of_a_parameter_is_its_own_entry():
    params = init_params(CFG)
    params["w_up"][1] = 127  # layer 1's up-projection saturated, layer 0's untouched
    health = weight_health(CFG, params)
    names = list(health)
    assert names[:2] == ["embedding", "emb_bias"]
    assert names[8:10] == ["layers.0.ln_1", "layers.0.ln_1_bias"]
    assert names[-2:] == ["ln_f", "ln_f_bias"]
    assert (
        len(names)
        == len(set(names))
        == health_entries(CFG) - len(HEALTH_ACTIVATIONS)
        == 8 + 2 * 12 + 2
    )
    assert health["layers.1.w_up"] == Stats(127.0, 0.0, 1.0, 0.0)
    assert health["layers.0.w_up"] == int8_stats(params["w_up"][0])
    assert health["layers.0.w_up"].saturation == 0 and health["layers.0.w_up"].entropy > 3
    assert health["ln_init"] == Stats(16.0, 0.0, 0.0, 0.0)  # a norm starts at 1.0 in Q.4


def test_activations_of_the_unperturbed_model():
    params, overlays = init_params(CFG), init_overlays(CFG)
    tokens = np.random.default_rng(0).integers(0, 256, (3, CFG.model.seq_len))
    health = activation_health(CFG, params, overlays, tokens)
    assert list(health) == list(HEALTH_ACTIVATIONS) == ["act.embedding", "act.final_norm"]
    embedded = params["embedding"].T[tokens]  # the embedding bias starts at zero
    assert health["act.embedding"] == int8_stats(embedded)
    final = health["act.final_norm"]
    assert 0 < final.std <= 128 and 0 < final.entropy <= 8 and 0 <= final.saturation <= 1
    assert activation_health(CFG, params, overlays, tokens) == health  # deterministic
