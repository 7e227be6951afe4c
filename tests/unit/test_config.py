import pytest

from dspark.config import ConfigError, load_config


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg.train.drafter == "dspark"
    assert cfg.flat()["train.lr"] == cfg.train.lr


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1.0e-3\n  gamma: 5\ncache:\n  codec: fp8\n")
    cfg = load_config(f, ["train.lr=3e-4", "cache.layers=[1,3]"])
    assert cfg.train.lr == pytest.approx(3e-4)  # the override wins over the file
    assert cfg.train.gamma == 5 and cfg.cache.codec == "fp8" and cfg.cache.layers == [1, 3]


@pytest.mark.parametrize(
    "override, named",
    [
        ("train.lrr=1", "train.lrr: unknown key"),
        ("trian.lr=1", "trian: unknown key"),
        ("train.lr=fast", "train.lr:"),
        ("train.gamma=0", "train.gamma:"),
        ("cache.codec=fp4", "cache.codec:"),
        ("train.lr.x=1", "train.lr"),
        ("eval.calibration_prompts_per_domain=1", "eval.calibration_prompts_per_domain:"),  # halves: >= 2
    ],
)
def test_bad_keys_and_values_name_the_key(override, named):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert named in str(e.value)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match="valid here: .*lr"):
        load_config(overrides=["train.lrr=1"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(overrides=["train.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize(
    "override, named",
    [
        ("cache.layers=[1,", "override cache.layers: the value is not valid YAML"),
        ("train.lr={a: 1", "override train.lr: the value is not valid YAML"),
        ("serve.api_key=@secret", "override serve.api_key: the value is not valid YAML"),
    ],
)
def test_invalid_yaml_in_an_override_is_one_line_naming_the_key(override, named):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert named in str(e.value) and "\n" not in str(e.value) and "secret" not in str(e.value)


def test_unreadable_config_files_are_one_line_naming_the_file(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("train:\n  run_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_config(latin1)
    assert str(e.value) == f"config file {latin1} is not UTF-8 text (byte 0xe9 at offset 22)"
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value).startswith(f"config file {bad} is not valid YAML: ") and "\n" not in str(e.value)
