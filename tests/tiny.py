"""The smallest model the tests train: shared, so each test states only what it changes."""

from deggs.config import Config

TINY = Config().replace(
    model=dict(hidden_dim=32, head_dim=32, n_layers=1, seq_len=8, vocab_size=256),
    training=dict(population_size=16, chunk_size=8),
)


def tiny_config(**tables) -> Config:
    """TINY with some keys changed: tiny_config(model=dict(vocab_size=70))."""
    return TINY.replace(**tables) if tables else TINY


def toml_of(cfg: Config) -> str:
    """A config as config.toml text, for the tests that start deggs commands with
    --config."""
    return cfg.to_toml()
