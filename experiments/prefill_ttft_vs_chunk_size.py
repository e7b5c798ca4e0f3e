"""How do TTFT and prefill tokens/s of a model depend on the prefill chunk size?

An experiment is data (one frozen object) plus one call. Run: python experiments/prefill_ttft_vs_chunk_size.py
(the `tiny` preset on CPU by default; on a GPU set `preset="qwen3.6-35b-a3b"` and `expert_format="int8"`).
Writes results/prefill_ttft_vs_chunk_size.json and, with matplotlib installed, a plot beside it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np

import hybridlm


@dataclasses.dataclass(frozen=True)
class PrefillSweep:
    preset: str = "tiny"
    expert_format: str | None = None          # None, "int8" or "int4"
    prompt_tokens: int = 4096
    chunk_sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    repeats: int = 2


EXPERIMENT = PrefillSweep()


def run(exp: PrefillSweep, results_dir: str = "results") -> list[dict]:
    config = hybridlm.get_config(exp.preset)
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    model = hybridlm.init_random(config, seed=0, dtype=dtype, expert_format=exp.expert_format)
    runner = hybridlm.LayerwiseRunner(model)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, exp.prompt_tokens)
    rows = []
    for chunk in exp.chunk_sizes:
        hybridlm.prefill(runner, ids, chunk_size=chunk)                  # compile
        ttft = min(hybridlm.prefill(runner, ids, chunk_size=chunk).ttft_s for _ in range(exp.repeats))
        rows.append({"chunk_size": chunk, "ttft_s": ttft, "tokens_per_s": exp.prompt_tokens / ttft})
        print(rows[-1])
    out = pathlib.Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"experiment": dataclasses.asdict(exp), "device": jax.devices()[0].device_kind,
            "jax_version": jax.__version__}
    (out / "prefill_ttft_vs_chunk_size.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["chunk_size"] for r in rows], [r["tokens_per_s"] for r in rows], "o-")
        ax.set(xscale="log", xlabel="chunk size (tokens)", ylabel="prefill tokens/s",
               title=f"{exp.preset}, {exp.prompt_tokens}-token prompt, {meta['device']}")
        fig.tight_layout()
        fig.savefig(out / "prefill_ttft_vs_chunk_size.png", dpi=120)
    except ImportError:
        pass
    return rows


if __name__ == "__main__":
    run(EXPERIMENT)
