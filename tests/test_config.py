import re
from pathlib import Path

import pytest

from deggs.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_default_config_toml_equals_built_in_defaults():
    assert load_config(ROOT / "config.toml") == Config()
    assert load_config(None) == Config()


@pytest.mark.parametrize(
    "toml, key",
    [
        ("[model]\nhidden_dim = 96\nhead_dim = 64\n", "model.hidden_dim"),  # not a multiple of head
        ("[model]\nhidden_dim = 80\nhead_dim = 40\n", "model.hidden_dim"),  # not a multiple of 32
        ("[training]\npopulation_size = 100\nchunk_size = 40\n", "training.population_size"),
        ("[training]\npopulation_size = 99\nchunk_size = 33\n", "training.chunk_size"),  # odd
        ("[model]\nhiden_dim = 256\n", "model.hiden_dim"),  # unknown key
        ("[modle]\nhidden_dim = 256\n", "[modle]"),  # unknown table
        ('[model]\nhidden_dim = "256"\n', "model.hidden_dim"),  # wrong type
        ("[training]\nsame_data = 1\n", "training.same_data"),
        ('[softmax]\nexp_scale = "six"\n', "softmax.exp_scale"),
        ("[optimizer]\nkind = 3\n", "optimizer.kind"),
        ('[optimizer]\nkind = "adam"\n', "optimizer.kind"),
        ('[optimizer]\nlr_schedule = [[0, "fast"]]\n', "optimizer.lr_schedule"),
        ("[coordinator]\nport = 70000\n", "coordinator.port"),
        ("model = 3\n", "[model]"),
    ],
)
def test_invalid_configs_name_the_key(tmp_path, toml, key):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, toml))
    assert key in str(err.value)
    assert str(tmp_path / "config.toml") in str(err.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))


def test_partial_file_takes_defaults(tmp_path):
    config = load_config(write(tmp_path, "[model]\nseq_len = 16\n"))
    assert config.model.seq_len == 16
    assert config.replace(model={"seq_len": 64}) == Config()


def test_fingerprint_ignores_coordinator_table_only():
    base = Config()
    assert len(base.fingerprint()) == 8
    assert base.replace(coordinator={"port": 1}).fingerprint() == base.fingerprint()
    other = base.replace(model={"seq_len": 32})
    assert other.fingerprint() != base.fingerprint()
    assert base.differences(other) == ["model.seq_len: 64 != 32"]


def test_json_round_trip():
    config = Config().replace(training={"population_size": 40, "chunk_size": 10})
    assert Config.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match="malformed"):
        Config.from_json("{")


@pytest.mark.parametrize(
    "tables, message",
    [
        (dict(optimizer=dict(lr_schedule=[[0, -0.5]])), "optimizer.lr_schedule: learning rates"),
        (dict(optimizer=dict(weight_decay=-0.1)), "optimizer.weight_decay: must not be negative"),
        (dict(optimizer=dict(bias_lr_scale=-1.0)), "optimizer.bias_lr_scale"),
        (dict(model=dict(seq_len=100_000_000)), "model.seq_len: at most 8192"),
        (dict(model=dict(hidden_dim=4096, head_dim=64)), "model.hidden_dim: at most 2048"),
        (dict(model=dict(vocab_size=2**21)), "model.vocab_size: at most 1048576"),
        (dict(training=dict(population_size=-1024)), "training.population_size: must be positive"),
        (dict(sampling=dict(temperature=float("inf"))), "sampling.temperature must be a finite"),
        (dict(optimizer=dict(lr_schedule=[[0, float("nan")]])), "optimizer.lr_schedule entries"),
        (dict(coordinator=dict(host="")), "coordinator.host: must not be empty"),
        (dict(eval=dict(health_every_steps=-1)), "eval.health_every_steps: must not be negative"),
        (dict(eval=dict(health_every_steps=2.5)), "eval.health_every_steps must be an integer"),
        (dict(eval=dict(saturation_warning=1.5)), "eval.saturation_warning: must be in [0, 1]"),
        (dict(eval=dict(saturation_warning="5%")), "eval.saturation_warning must be a finite"),
    ],
)
def test_impossible_values_are_refused_by_name(tables, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config().replace(**tables)


def test_set_overrides_are_typed_by_the_key_and_validated():
    from deggs.config import override

    cfg = override(
        Config(),
        [
            "training.seed=3",
            "model.seq_len = 16",
            "optimizer.lr_schedule=[[0, 0.25], [10, 0.1]]",
            "coordinator.host=127.0.0.1",
            "fitness.chunk_mean_filter=false",
        ],
    )
    assert cfg.training.seed == 3 and cfg.model.seq_len == 16
    assert cfg.optimizer.lr_schedule == ((0, 0.25), (10, 0.1))
    assert cfg.coordinator.host == "127.0.0.1" and cfg.fitness.chunk_mean_filter is False
    for item, message in [
        ("training.sed=3", "unknown key training.sed"),
        ("seed=3", "expected table.key=value"),
        ("model.seq_len=abc", "model.seq_len must be an integer, not 'abc'"),
        ("model.seq_len=0", "model.seq_len: must be positive"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            override(Config(), [item])


def test_packaged_configs_load_by_name_and_a_file_of_that_name_wins(tmp_path, monkeypatch):
    assert load_config("default") == Config()  # the very file config.toml links to
    small = load_config("small")
    assert (small.model.hidden_dim, small.training.population_size) == (64, 1024)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small").write_text("[model]\nn_layers = 3\n")
    assert load_config("small").model.n_layers == 3  # a file is a file


@pytest.mark.parametrize(
    "name, message",
    [
        ("smal", "config file not found: smal (did you mean small?)"),
        ("nothing.toml", "config file not found: nothing.toml (packaged configs: default, small)"),
    ],
)
def test_a_config_that_is_neither_a_file_nor_a_name_says_which_there_are(
    tmp_path, monkeypatch, name, message
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(name)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[model]\nhiden_dim = 256\n", "unknown key model.hiden_dim (did you mean hidden_dim?)"),
        ("[modle]\n", "unknown table [modle] (did you mean model?)"),
        ("[model]\nzzz = 1\n", "unknown key model.zzz (known: hidden_dim, head_dim, n_layers,"),
    ],
)
def test_unknown_names_get_the_closest_known_one(tmp_path, toml, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write(tmp_path, toml))


def test_sets_key_reads_only_the_users_own_file(tmp_path):
    from deggs.config import sets_key

    path = write(tmp_path, "[model]\nvocab_size = 512\n")
    assert sets_key(path, "model", "vocab_size")
    assert not sets_key(path, "model", "seq_len")
    assert not sets_key("small", "model", "vocab_size")  # a packaged config's are defaults
    assert not sets_key(None, "model", "vocab_size")
