"""What the GPU backend can run, decided before a kernel is compiled (no GPU needed)."""

import re

import pytest

from deggs.config import Config
from deggs.numerics.gpu import KERNELS, choose_token_threads, kernel_source, supports

H100_OPTIN = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin of an H100 (227 KiB)


def config(**model):
    return Config().replace(model=model)


def test_the_default_and_the_size_limits_fit_an_h100():
    assert supports(Config(), H100_OPTIN) == []
    assert supports(config(hidden_dim=2048, head_dim=128), H100_OPTIN) == []
    assert supports(config(vocab_size=65536), H100_OPTIN) == []  # 16-bit output noise
    assert supports(config(seq_len=256, head_dim=128), H100_OPTIN) == []


def test_what_does_not_fit_is_named():
    mode2 = Config().replace(model=dict(vocab_size=65536), adaptive_noise=dict(mode=2))
    (problem,) = supports(mode2, H100_OPTIN)  # mode 2's output noise needs 32 bits
    assert problem.startswith("sequence_loss needs 263") and "allows 232448" in problem
    problems = supports(config(seq_len=1024, head_dim=32, hidden_dim=64), H100_OPTIN)
    assert any("seq_len 1024 needs 2048 threads" in p for p in problems)
    small_device = supports(config(hidden_dim=2048, head_dim=128), 48 << 10)
    assert {p.split()[0] for p in small_device} == {"standard_norm", "mlp_up"}


@pytest.mark.parametrize("hidden, threads", [(64, 64), (1024, 1024), (1536, 768), (2048, 1024)])
def test_choose_token_plays_the_references_threads(hidden, threads):
    assert choose_token_threads(hidden) == threads and hidden % threads == 0


def test_every_kernel_is_in_the_shipped_sources():
    source = kernel_source()
    defined = set(re.findall(r'extern "C" __global__ void (\w+)\(', source))
    assert defined == set(KERNELS)
