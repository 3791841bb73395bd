"""The SGLang settings `chunkcache serve` starts both sides of the A/B comparison with."""

import argparse
import os

import pytest

from chunkcache.config import Config
from chunkcache.cpu_dtype import Choice
from sglang_patch.serve import launcher


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(launcher, "has_gpu", lambda: False)


@pytest.mark.parametrize("fastest", ["bfloat16", "float32"])
@pytest.mark.parametrize("chunk_reuse", [True, False])
def test_cpu_serves_the_hosts_fastest_dtype_and_sleeps_when_idle(cpu, monkeypatch, chunk_reuse, fastest):
    monkeypatch.setattr(launcher, "fastest_cpu_dtype", lambda: Choice(fastest, {}, "host"))
    settings = launcher.server_settings("/models/m", Config(), chunk_reuse=chunk_reuse)
    assert settings["dtype"] == fastest and settings["sleep_on_idle"] is True
    assert settings["device"] == "cpu" and settings["attention_backend"] == "chunkcache_torch"
    assert (settings.get("radix_cache_backend") == launcher.BACKEND_NAME) == chunk_reuse


def test_dtype_and_sleep_on_idle_come_from_the_config(cpu, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("serve:\n  dtype: float32\n  sleep_on_idle: false\n")
    argv = launcher.to_argv(launcher.server_settings("/models/m", Config.load(path)))
    assert argv[argv.index("--dtype") + 1] == "float32" and "--sleep-on-idle" not in argv


def test_gpu_leaves_the_dtype_to_sglang(monkeypatch):
    monkeypatch.setattr(launcher, "has_gpu", lambda: True)
    settings = launcher.server_settings("/models/m", Config())
    assert settings["dtype"] == "auto" and "device" not in settings


def test_packaged_default_is_the_built_in_default():
    assert Config.load().to_dict() == Config().to_dict()


def test_sglang_parses_every_setting_back(cpu):
    """The argv `chunkcache serve` hands to sglang.launch_server means what the settings say (flag names included)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # as sglang.launch_server does before parsing: the plugin registers its attention backend
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    settings = launcher.server_settings("/models/m", Config())
    args = vars(parser.parse_args(launcher.to_argv(settings)))
    assert {key: args[key] for key in settings} == settings


def test_cpu_attention_backend_comes_from_the_config(cpu, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("serve:\n  cpu_attention: torch_native\n")
    assert launcher.server_settings("/models/m", Config.load(path))["attention_backend"] == "torch_native"
    path.write_text("serve:\n  cpu_attention: flashinfer\n")
    with pytest.raises(ValueError, match="cpu_attention"):
        Config.load(path)


def stock_command_args(*argv: str):
    """ServerArgs as `python -m sglang.launch_server ARGV` has them when it resolves them (plugins loaded first)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    return prepare_server_args(["--model-path", "/models/m", *argv])


def test_stock_command_on_cpu_gets_the_cpu_engine_and_keeps_its_own_flags(cpu, monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.delenv(launcher.CONFIG_ENV, raising=False)
    monkeypatch.setattr(launcher, "fastest_cpu_dtype", lambda: Choice("bfloat16", {}, "host"))
    args = stock_command_args("--radix-cache-backend", "chunkcache", "--dtype", "float32")
    launcher.cpu_engine_for_stock_command(args)
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    expected = launcher.server_settings("/models/m", Config.load())
    for key in ("device", "attention_backend", "disable_cuda_graph", "disable_overlap_schedule",
                "mem_fraction_static", "sleep_on_idle"):
        assert getattr(args, key) == expected[key], key
    assert args.dtype == "float32"  # given on the command line: not this host's CPU default (bfloat16 here)
    assert (args.host, args.port) == ("127.0.0.1", 30000)


@pytest.mark.parametrize("gpu, argv", [(True, ["--radix-cache-backend", "chunkcache"]), (False, [])])
def test_stock_command_is_left_alone_on_gpu_or_without_chunk_reuse(monkeypatch, gpu, argv):
    monkeypatch.setattr(launcher, "has_gpu", lambda: gpu)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    args = stock_command_args(*argv)
    before = repr(args)
    launcher.cpu_engine_for_stock_command(args)
    assert repr(args) == before and "SGLANG_USE_CPU_ENGINE" not in os.environ
