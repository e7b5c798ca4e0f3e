"""`hybridlm prefill --expert-budget ... --cache-policy ...` prints the offload statistics."""

import json

from hybridlm import cli
from hybridlm.offload.config import tuned_default


def test_cli_prefill_offload_json(capsys):
    rc = cli.main(
        [
            "prefill",
            "--prompt",
            "The expert cache pages weights between host and device.",
            "--chunk-size",
            "16",
            "--expert-budget",
            "2MiB",
            "--cache-policy",
            "static",
            "--json",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stats = report["offload"]
    assert stats["pool"]["policy"] == "static" and stats["pool"]["budget_bytes"] == 2 * 2**20
    s = stats["prefill"]
    assert s["lookups"] > 0 and s["hits"] + s["misses"] == s["lookups"]
    assert len(s["per_layer"]) == 8


def test_cli_prefill_offload_text_and_budget_error(capsys):
    rc = cli.main(
        [
            "prefill",
            "--prompt",
            "Hello there",
            "--chunk-size",
            "16",
            "--expert-budget",
            "1MiB",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "expert offload budget 1.00 MiB" in out and "hit rate" in out
    rc = cli.main(["prefill", "--prompt", "Hello there", "--expert-budget", "64KiB"])
    assert rc == 2
    assert "one layer needs up to" in capsys.readouterr().err


def test_cli_generate_offload_decodes_paged_by_the_device(capsys):
    """`hybridlm generate` with an expert budget: the same tokens as without one; the decode statistics count
    the device-paged steps (their transfer rate untimed: those steps are never waited for)."""
    args = [
        "generate",
        "--prompt",
        "Experts page in as the router picks them.",
        "--chunk-size",
        "16",
        "--max-new-tokens",
        "4",
    ]
    assert cli.main(args) == 0
    resident = capsys.readouterr().out
    assert cli.main(args + ["--expert-budget", "1MiB", "--cache-policy", "lru"]) == 0
    out = capsys.readouterr().out
    generated = [line for line in out.splitlines() if line.startswith("generated")]
    assert generated and generated == [line for line in resident.splitlines() if line.startswith("generated")]
    decode = next(
        line for line in out.splitlines() if line.strip().startswith("decode") and "lookups" in line
    )
    assert "GB/s untimed" in decode and "lookups 96" in decode  # 3 steps x 8 layers x top-4
    assert cli.main(args + ["--expert-budget", "1MiB", "--cache-policy", "lru", "--host-parts", "1"]) == 0
    one_part = capsys.readouterr().out
    assert [line for line in one_part.splitlines() if line.startswith("generated")] == generated
    assert cli.main(args + ["--expert-budget", "1MiB", "--host-parts", "0"]) == 2
    assert "host_parts=0 must be >= 1" in capsys.readouterr().err


def test_cli_generate_picks_one_host_part_for_long_answers(capsys):
    """Without --host-parts, `generate` keeps one host buffer a layer from one_host_part_from_tokens new
    tokens on, and `prefill` the runner's default; --host-parts overrides both. The report names the
    choice."""
    threshold = tuned_default("one_host_part_from_tokens")
    assert cli.host_parts_for("generate", threshold, None) == 1
    assert cli.host_parts_for("generate", threshold - 1, None) is None
    assert cli.host_parts_for("prefill", 0, None) is None
    assert cli.host_parts_for("generate", 1000, 4) == 4
    rc = cli.main(
        [
            "prefill",
            "--prompt",
            "Hello there",
            "--chunk-size",
            "16",
            "--expert-budget",
            "1MiB",
            "--json",
        ]
    )
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["offload"]["pool"]["host_parts"] == 4
    rc = cli.main(
        [
            "prefill",
            "--prompt",
            "Hello there",
            "--chunk-size",
            "16",
            "--expert-budget",
            "1MiB",
            "--host-parts",
            "2",
        ]
    )
    assert rc == 0 and "2 host buffer(s) a layer" in capsys.readouterr().out
