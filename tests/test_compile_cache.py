"""The persistent compilation cache hybridlm turns on: where it lives, how it is turned off, that a directory
the user set in JAX is kept, and the CLI's report of compile time and cache use."""

import json
import types

import jax
import pytest

from hybridlm import cli, compile_cache


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDLM_COMPILE_CACHE", str(tmp_path / "c"))
    assert compile_cache.default_dir() == str(tmp_path / "c")
    for off in ("off", "0", "", "none"):
        monkeypatch.setenv("HYBRIDLM_COMPILE_CACHE", off)
        assert compile_cache.default_dir() is None
    monkeypatch.delenv("HYBRIDLM_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "hybridlm" / "jax")


def test_a_directory_set_in_jax_is_kept(tmp_path):
    current = jax.config.jax_compilation_cache_dir  # the test session's (conftest)
    assert current
    assert compile_cache.enable(str(tmp_path / "other")) == current
    assert jax.config.jax_compilation_cache_dir == current


def test_enable_sets_the_directory_when_jax_has_none(monkeypatch, tmp_path):
    updates = {}
    fake = types.SimpleNamespace(
        jax_compilation_cache_dir=None, update=lambda key, value: updates.__setitem__(key, value)
    )
    monkeypatch.setattr(compile_cache, "jax", types.SimpleNamespace(config=fake))
    assert compile_cache.enable(str(tmp_path / "jc")) == str(tmp_path / "jc")
    assert updates["jax_compilation_cache_dir"] == str(tmp_path / "jc")
    assert updates["jax_persistent_cache_min_compile_time_secs"] == 0.0
    assert (tmp_path / "jc").is_dir()
    assert compile_cache.enable("off") is None


def test_counters_see_a_compilation():
    counters = compile_cache.counters()
    before = counters.snapshot()
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0)).block_until_ready()
    after = counters.snapshot()
    assert after["compile_s"] > before["compile_s"]
    assert after["cache_hits"] + after["cache_misses"] > before["cache_hits"] + before["cache_misses"]


@pytest.mark.parametrize("command", ["prefill", "generate"])
def test_cli_reports_load_compile_and_first_token(capsys, command):
    extra = ["--max-new-tokens", "2"] if command == "generate" else []
    assert cli.main([command, "--prompt", "The quick brown fox", "--json", *extra]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["load_s"] > 0 and report["peak_rss_bytes"] > 0
    assert report["command_to_first_token_s"] >= report["ttft_s"] > 0
    assert report["compile"]["cache_dir"] == jax.config.jax_compilation_cache_dir
    assert set(report["compile"]) == {"cache_dir", "compile_s", "cache_hits", "cache_misses"}
