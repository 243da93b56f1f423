"""Settings: files in configs/ load, layers override in the documented order, mistakes are named."""

from dataclasses import fields
from pathlib import Path

import pytest

from kvserve.engine import EngineConfig
from kvserve.server import cli
from kvserve.server.settings import ServerSettings, SettingsError, load_settings

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config_file", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(config_file):
    settings = load_settings(config_file, {}, environ={})
    assert isinstance(settings.engine_config(), EngineConfig)


def test_default_yaml_states_the_defaults():
    assert load_settings(Path("configs/default.yaml"), {}, environ={}) == ServerSettings()


def test_engine_settings_reach_the_engine_config(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("max_num_seqs: 3\nenable_prefix_caching: false\nmax_prefill_chunk_tokens: 64\n")
    engine_config = load_settings(config_file, {"block_size": 32}, environ={}).engine_config()
    assert (engine_config.max_num_seqs, engine_config.enable_prefix_caching) == (3, False)
    assert (engine_config.max_prefill_chunk_tokens, engine_config.block_size) == (64, 32)
    assert {f.name for f in fields(EngineConfig)} <= set(ServerSettings.model_fields)


def test_flags_override_env_which_overrides_the_file(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("max_num_seqs: 4\nport: 9000\nserved_model_name: from-file\n")
    env = {"KVSERVE_MAX_NUM_SEQS": "8", "KVSERVE_SERVED_MODEL_NAME": "from-env"}
    settings = load_settings(config_file, {"served_model_name": "from-flag", "port": None}, environ=env)
    assert (settings.max_num_seqs, settings.port, settings.served_model_name) == (8, 9000, "from-flag")


@pytest.mark.parametrize(
    ("content", "env", "named"),
    [
        ("max_num_seq: 4\n", {}, "max_num_seq"),
        ("port: many\n", {}, "port"),
        ("", {"KVSERVE_MAX_NUM_SEQS": "lots"}, "max_num_seqs"),
        ("- a\n- b\n", {}, "mapping"),
        ("enable_prefix_caching: maybe\n", {}, "enable_prefix_caching"),
        ("max_num_seqs: 4.5\n", {}, "max_num_seqs"),
        ("cors_allow_origins: 7\n", {}, "cors_allow_origins"),
        ("port: 70000\n", {}, "port"),
        ("block_size: 24\n", {}, "block_size"),  # EngineConfig's own check, run at load time too
        ("gpu_memory_utilization: 1.5\n", {}, "gpu_memory_utilization"),
        ("scheduling_policy: lifo\n", {}, "scheduling_policy"),
    ],
)
def test_unknown_keys_and_wrong_types_are_refused_by_name(tmp_path, content, env, named):
    config_file = tmp_path / "c.yaml"
    config_file.write_text(content)
    with pytest.raises(SettingsError, match=named):
        load_settings(config_file, {}, environ=env)


def test_the_scheduling_policy_comes_from_yaml_env_or_flag_and_reaches_the_engine(tmp_path):
    assert ServerSettings().scheduling_policy == EngineConfig().scheduling_policy == "fcfs"
    config_file = tmp_path / "c.yaml"
    config_file.write_text("scheduling_policy: priority\n")
    assert load_settings(config_file, {}, environ={}).engine_config().scheduling_policy == "priority"
    env = {"KVSERVE_SCHEDULING_POLICY": "priority"}
    assert load_settings(None, {}, environ=env).engine_config().scheduling_policy == "priority"
    flag = cli._parse_args(["serve", "--scheduling-policy", "fcfs"]).scheduling_policy
    assert load_settings(config_file, {"scheduling_policy": flag}, environ=env).scheduling_policy == "fcfs"


def test_kvserve_serve_refuses_a_scheduling_policy_it_does_not_have(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--scheduling-policy", "lifo"])
    assert exit_info.value.code == 2
    assert "--scheduling-policy" in capsys.readouterr().err


def test_kvserve_serve_refuses_a_bad_config_file_before_loading_anything(tmp_path, capsys):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("max_num_seqs: 4\nmax_batch: 8\n")
    assert cli.main(["serve", "--config", str(config_file)]) == 2
    assert "max_batch" in capsys.readouterr().err


def test_kvserve_serve_refuses_a_flag_of_the_wrong_type(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--max-num-seqs", "lots"])
    assert exit_info.value.code == 2
    assert "--max-num-seqs" in capsys.readouterr().err


def test_lora_modules_come_as_name_equals_path_or_objects_from_flags_env_and_yaml(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("enable_lora: true\nlora_modules:\n  - {name: a, path: /adapters/a}\n  - b=/adapters/b\n")
    assert load_settings(config_file, {}, environ={}).engine_config().lora_modules == (
        ("a", "/adapters/a"), ("b", "/adapters/b"),
    )  # fmt: skip
    env = {"KVSERVE_ENABLE_LORA": "true", "KVSERVE_LORA_MODULES": '[c=/adapters/c, {"name": "d", "path": "/d"}]'}
    assert load_settings(None, {}, environ=env).lora_modules == (("c", "/adapters/c"), ("d", "/d"))
    args = cli._parse_args(["serve", "--enable-lora", "--lora-modules", "e=/adapters/e", "f=/adapters/f"])
    assert args.lora_modules == ["e=/adapters/e", "f=/adapters/f"]
    for bad in (["nameonly"], [{"name": "x"}]):
        with pytest.raises(SettingsError, match="LoRA module"):
            load_settings(None, {"enable_lora": True, "lora_modules": bad}, environ={})
    with pytest.raises(SettingsError, match="lora_modules needs enable_lora"):
        load_settings(None, {"lora_modules": ["a=/x"]}, environ={})
