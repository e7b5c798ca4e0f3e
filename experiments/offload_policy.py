"""Offloaded prefill and decode at one expert budget: which cache policy wins?"""

from __future__ import annotations

import dataclasses

from benchmarks import registry
from experiments import plotting


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPolicySweep:
    name: str = "offload_policy"
    preset: str = "qwen3.6-35b-a3b"
    expert_format: str = "int4"
    budget: str = "12GiB"
    policies: tuple[str, ...] = ("static", "lru", "slru", "lfu", "stream")
    prompt_tokens: int = 32768
    chunk_size: int = 32768
    decode_tokens: int = 128  # greedy decode after a 512-token prompt (0: prefill only)
    num_layers: int | None = None  # a shallower model (tests)

    def argv(self) -> list[str]:
        """The `python -m benchmarks offload` arguments of this sweep."""
        argv = [
            "--preset",
            self.preset,
            "--expert-format",
            self.expert_format,
            "--budget",
            self.budget,
            "--policy",
            *self.policies,
            "--prompt-tokens",
            str(self.prompt_tokens),
            "--chunk-size",
            str(self.chunk_size),
            "--no-resident",
            "--decode-tokens",
            str(self.decode_tokens),
        ]
        return argv + (["--num-layers", str(self.num_layers)] if self.num_layers else [])


EXPERIMENT = OffloadPolicySweep()
TINY = OffloadPolicySweep(
    preset="tiny",
    budget="1MiB",
    policies=("static", "lru"),
    prompt_tokens=32,
    chunk_size=16,
    decode_tokens=0,
    num_layers=4,
)


def run(exp: OffloadPolicySweep, img_dir=plotting.IMG_DIR, out: str | None = None) -> list[dict]:
    """Measures the sweep (`benchmarks offload`), plots prefill (and decode) tokens/s with the hit rate per
    policy; the records."""
    records = registry.run("offload", exp.argv() + (["--out", out] if out else []))
    rows = plotting.measured(records, "hybridlm.offload")
    parts = {
        "prefill": [r for r in rows if "prompt_tokens" in r["params"]],
        "decode": [r for r in rows if "prompt_tokens" not in r["params"]],
    }
    parts = {label: part for label, part in parts.items() if part}
    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 3.8), squeeze=False)
    for ax, (label, part) in zip(axes[0], parts.items(), strict=True):
        tokens_per_s = [r["figures"]["tokens_per_s"] for r in part]
        ax.bar([r["params"]["policy"] for r in part], tokens_per_s)
        ax.set(ylabel=f"{label} tokens/s")
        for i, r in enumerate(part):
            ax.annotate(
                f"hit {r['figures']['hit_rate']:.2f}",
                (i, tokens_per_s[i]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    what = f"{exp.preset}, {exp.expert_format} experts, budget {exp.budget}, {exp.prompt_tokens} tokens"
    fig.suptitle(plotting.title(rows, what), fontsize=9)
    plotting.save(fig, img_dir, exp.name)
    return records


if __name__ == "__main__":
    plotting.main({"full": EXPERIMENT, "tiny": TINY}, run, __doc__)
