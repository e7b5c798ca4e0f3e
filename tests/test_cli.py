"""`hybridlm prefill|generate`: the main job on the embedded default, options and one-line errors."""

import json
import subprocess
import sys

import pytest

from hybridlm.cli import main


def test_prefill_default_json_times_one_pass(capsys):
    assert main(["prefill", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"].startswith("tiny") and report["prompt_tokens"] > 3000
    assert report["prefill_tokens_per_s"] > 0 and report["ttft_s"] > 0
    assert report["chunks"] == -(-report["prompt_tokens"] // report["chunk_size"])
    assert (
        report["compile_excluded"] is False and report["profiled"] is False and "phase_seconds" not in report
    )


def test_prefill_warmup_and_profile_say_so(capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    argv = ["prefill", "--prompt-file", str(prompt), "--chunk-size", "64"]
    assert main([*argv, "--warmup", "--profile", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compile_excluded"] is True and report["profiled"] is True
    assert set(report["phase_seconds"]) == {"embed", "gdn", "attention", "router", "experts", "head"}
    assert main([*argv, "--warmup", "--profile"]) == 0
    text = capsys.readouterr().out
    assert "s (after warm-up)" in text and "per phase (profiled pass" in text
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "s (includes compilation)" in text and "per phase" not in text


def test_generate_with_options(capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert (
        main(
            [
                "generate",
                "--prompt-file",
                str(prompt),
                "--chunk-size",
                "64",
                "--max-new-tokens",
                "3",
                "--temperature",
                "0.7",
                "--top-k",
                "20",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert len(report["new_tokens"]) == 3 and isinstance(report["text"], str)
    assert report["chunk_size"] == 64 and report["chunks"] > 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["prefill", "--preset", "qwen9"], "unknown preset 'qwen9'"),
        (["prefill", "--model", "/no/such/model.gguf"], "model path not found"),
        (["prefill", "--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
        (["prefill", "--chunk-size", "0"], "--chunk-size must be positive"),
        (["generate", "--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
        (["generate", "--top-p", "0"], "--top-p=0.0 must lie in (0, 1]"),
    ],
)
def test_errors_are_one_line_with_nonzero_exit(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_console_script_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "hybridlm", "prefill", "--preset", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2 and "unknown preset" in out.stderr
