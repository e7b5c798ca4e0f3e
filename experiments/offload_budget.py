"""Offloaded prefill: how do tokens/s and the expert-cache hit rate grow with the device expert budget?"""

from __future__ import annotations

import dataclasses

from benchmarks import registry
from experiments import plotting


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadBudgetSweep:
    name: str = "offload_budget"
    preset: str = "qwen3.6-35b-a3b"
    expert_format: str = "int4"
    budgets: tuple[str, ...] = ("6GiB", "9GiB", "12GiB", "16GiB")
    policy: str = "static"
    prompt_tokens: int = 32768
    chunk_size: int = 32768
    resident: bool = True  # also the all-resident prefill, drawn as a line
    num_layers: int | None = None  # a shallower model (tests)

    def argv(self) -> list[str]:
        """The `python -m benchmarks offload` arguments of this sweep."""
        argv = [
            "--preset",
            self.preset,
            "--expert-format",
            self.expert_format,
            "--budget",
            *self.budgets,
            "--policy",
            self.policy,
            "--prompt-tokens",
            str(self.prompt_tokens),
            "--chunk-size",
            str(self.chunk_size),
        ]
        argv += [] if self.resident else ["--no-resident"]
        return argv + (["--num-layers", str(self.num_layers)] if self.num_layers else [])


EXPERIMENT = OffloadBudgetSweep()
TINY = OffloadBudgetSweep(
    preset="tiny", budgets=("384KiB", "1MiB"), prompt_tokens=32, chunk_size=16, resident=False, num_layers=4
)


def run(exp: OffloadBudgetSweep, img_dir=plotting.IMG_DIR, out: str | None = None) -> list[dict]:
    """Measures the sweep (`benchmarks offload`), plots tokens/s and hit rate against budget; the records."""
    records = registry.run("offload", exp.argv() + (["--out", out] if out else []))
    rows = [r for r in plotting.measured(records, "hybridlm.offload") if "prompt_tokens" in r["params"]]
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    gib = [r["params"]["budget_bytes"] / 2**30 for r in rows]
    ax.plot(gib, [r["figures"]["tokens_per_s"] for r in rows], "o-", label="offloaded")
    for r in plotting.measured(records, "hybridlm.resident"):
        if "ttft_s" in r["figures"]:
            ax.axhline(r["figures"]["tokens_per_s"], ls=":", color="gray", label="all resident")
    ax.set(xlabel="device expert budget (GiB)", ylabel="prefill tokens/s (o)")
    ax.legend(loc="lower right", fontsize=8)
    hits = ax.twinx()
    hits.plot(gib, [r["figures"]["hit_rate"] for r in rows], "s--", color="tab:orange")
    hits.set(ylabel="hit rate (squares)", ylim=(0, 1.05))
    what = f"{exp.preset}, {exp.expert_format} experts, {exp.policy}, {exp.prompt_tokens} tokens"
    ax.set_title(plotting.title(rows, what), fontsize=9)
    plotting.save(fig, img_dir, exp.name)
    return records


if __name__ == "__main__":
    plotting.main({"full": EXPERIMENT, "tiny": TINY}, run, __doc__)
