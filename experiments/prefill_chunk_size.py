"""How do TTFT and prefill tokens/s depend on the prefill chunk size (all weights resident)?"""

from __future__ import annotations

import dataclasses

from benchmarks import registry
from experiments import plotting


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillChunkSweep:
    name: str = "prefill_chunk_size"
    preset: str = "qwen3.6-35b-a3b"
    expert_format: str = "int4"
    prompt_tokens: int = 32768
    chunk_sizes: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    repeats: int = 3
    num_layers: int | None = None  # a shallower model (tests)

    def argv(self) -> list[str]:
        """The `python -m benchmarks prefill` arguments of this sweep."""
        argv = [
            "--preset",
            self.preset,
            "--expert-format",
            self.expert_format,
            "--prompt-tokens",
            str(self.prompt_tokens),
            "--chunk-size",
            *map(str, self.chunk_sizes),
            "--repeats",
            str(self.repeats),
        ]
        return argv + (["--num-layers", str(self.num_layers)] if self.num_layers else [])


EXPERIMENT = PrefillChunkSweep()
TINY = PrefillChunkSweep(preset="tiny", prompt_tokens=64, chunk_sizes=(16, 64), repeats=1, num_layers=4)


def run(exp: PrefillChunkSweep, img_dir=plotting.IMG_DIR, out: str | None = None) -> list[dict]:
    """Measures the sweep (`benchmarks prefill`), plots tokens/s and TTFT against chunk size; the records."""
    records = registry.run("prefill", exp.argv() + (["--out", out] if out else []))
    rows = plotting.measured(records, "hybridlm")
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    chunks = [r["params"]["chunk_size"] for r in rows]
    ax.plot(chunks, [r["figures"]["tokens_per_s"] for r in rows], "o-")
    ax.set(xscale="log", xlabel="chunk size (tokens)", ylabel="prefill tokens/s (o)")
    ttft = ax.twinx()
    ttft.plot(chunks, [r["figures"]["ttft_s"] for r in rows], "s--", color="tab:orange")
    ttft.set_ylabel("TTFT, s (squares)")
    what = f"{exp.preset}, {exp.expert_format} experts, {exp.prompt_tokens}-token prompt"
    ax.set_title(plotting.title(rows, what), fontsize=9)
    plotting.save(fig, img_dir, exp.name)
    return records


if __name__ == "__main__":
    plotting.main({"full": EXPERIMENT, "tiny": TINY}, run, __doc__)
