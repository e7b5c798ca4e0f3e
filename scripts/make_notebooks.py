"""Writes the notebooks in notebooks/ from the cells below (run: python scripts/make_notebooks.py)."""

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell(
        "# hybridlm quickstart\n\nBuild a model, ingest a prompt with chunked prefill (time to first "
        "token), look at where the time goes, and generate. Runs on CPU in about a minute with the "
        "`tiny` preset; on a GPU pick a real preset or `hybridlm.load(path)` a checkpoint."
    ),
    new_code_cell(
        "import jax, jax.numpy as jnp, numpy as np\nimport hybridlm\n"
        "print('JAX', jax.__version__, 'on', jax.devices()[0].device_kind)"
    ),
    new_markdown_cell(
        "## A model\n`get_config` has the published presets (`qwen3.5-35b-a3b`, `qwen3.6-35b-a3b`, "
        "`qwen3-next-80b-a3b`) and `tiny`: same architecture and full vocabulary, small everything "
        "else. `init_random` gives random weights; `hybridlm.load(path)` reads an HF checkpoint "
        "directory or a GGUF file."
    ),
    new_code_cell(
        "config = hybridlm.get_config('tiny')\n"
        "print(config.layer_types)\n"
        "print(f'{config.num_params() / 1e6:.1f} M parameters')\n"
        "model = hybridlm.init_random(config, seed=0)"
    ),
    new_markdown_cell("Loading a checkpoint works the same way; here one of the small HF test checkpoints:"),
    new_code_cell(
        "import pathlib\n"
        "ckpt = pathlib.Path('..') / 'tests' / 'fixtures' / 'hf' / 'qwen35moe_text'\n"
        "if ckpt.exists():\n"
        "    small = hybridlm.load(ckpt)\n"
        "    logits = small(jnp.arange(10)[None])          # [batch, seq, vocab]\n"
        "    print(small.config.name, logits.shape)"
    ),
    new_markdown_cell(
        "## Prefill\nThe prompt is tokenized with the real Qwen3.5/3.6 tokenizer and ingested in "
        "chunks; the state (GDN recurrent + conv state, KV cache) is carried between chunks."
    ),
    new_code_cell(
        "from hybridlm.tokenizer import default_prompt\n"
        "tokenizer = hybridlm.Tokenizer()\n"
        "ids = tokenizer.encode(default_prompt())\n"
        "runner = hybridlm.LayerwiseRunner(model)      # compiled functions are reused across calls\n"
        "hybridlm.prefill(runner, ids, chunk_size=1024)   # first call compiles\n"
        "result = hybridlm.prefill(runner, ids, chunk_size=1024)\n"
        "print(f'{result.prompt_tokens} tokens in {result.num_chunks} chunks: TTFT {result.ttft_s:.2f} s, '\n"
        "      f'{result.tokens_per_s:.0f} tokens/s')"
    ),
    new_markdown_cell(
        "## Where the time goes\n`profile=True` synchronises after every phase and sums wall time per "
        "phase (it removes overlap, so use it to compare phases, not for TTFT)."
    ),
    new_code_cell(
        "profiled = hybridlm.prefill(runner, ids, chunk_size=1024, profile=True)\n"
        "for phase, seconds in profiled.phase_seconds.items():\n"
        "    print(f'{phase:10s} {seconds * 1e3:8.1f} ms')"
    ),
    new_markdown_cell(
        "## Generate\nGreedy by default; `temperature`, `top_k`, `top_p` and `seed` for sampling. "
        "(Random weights produce random text.)"
    ),
    new_code_cell(
        "out = hybridlm.generate(runner, ids[:200], max_new_tokens=8, temperature=0.8, top_p=0.95, seed=0)\n"
        "print(out.tokens, repr(tokenizer.decode(out.tokens[0])))\n"
        "assert np.isfinite(np.asarray(out.prefill.logits)).all()"
    ),
]


OFFLOAD_CELLS = [
    new_markdown_cell(
        "# Expert offload\n"
        "\n"
        "Routed experts live in pinned host memory; a device **expert budget** (bytes) bounds the "
        "experts held on the GPU, and the scheduler pages the ones each chunk's router picks into a "
        "device expert cache, with prefetch. Same logits as the all-resident model. Here on the `tiny` "
        "preset (CPU JAX has a `pinned_host` memory kind too); on a GPU use e.g. `expert_budget='12GiB'` "
        "with `qwen3.6-35b-a3b` and 4-bit experts (`docs/offload.md`)."
    ),
    new_code_cell(
        "import numpy as np\n"
        "\n"
        "import hybridlm\n"
        "from hybridlm.offload import HostExperts, OffloadConfig, OffloadedRunner\n"
        "\n"
        "model = hybridlm.init_random(hybridlm.get_config('tiny'), seed=0)\n"
        "host = HostExperts.from_model(model)       # every expert, packed, in pinned host memory\n"
        "print(f'{host.num_layers} layers x {host.num_experts} experts x {host.layout.nbytes} bytes = "
        "{host.nbytes / 2**20:.1f} MiB')"
    ),
    new_markdown_cell(
        "## A budget of half the experts\n"
        "A budget that cannot hold one layer's active experts for a chunk is refused before any work "
        "starts."
    ),
    new_code_cell(
        "budget = host.nbytes // 2\n"
        "runner = OffloadedRunner(model, OffloadConfig(expert_budget=budget, cache_policy='slru'), "
        "host_experts=host)\n"
        "try:\n"
        "    OffloadedRunner(model, OffloadConfig(expert_budget=host.layout.nbytes, chunk_size=64), "
        "host_experts=host)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)"
    ),
    new_markdown_cell("## Prefill: same logits, and what moved"),
    new_code_cell(
        "ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 512)\n"
        "resident = hybridlm.prefill(hybridlm.LayerwiseRunner(model), ids, chunk_size=128)\n"
        "result = hybridlm.prefill(runner, ids, chunk_size=128)\n"
        "print('max |logit difference|:', float(np.abs(np.asarray(result.logits) - "
        "np.asarray(resident.logits)).max()))\n"
        "s = runner.stats()['prefill']\n"
        "print(f\"lookups {s['lookups']}  hits {s['hits']}  misses {s['misses']}  hit rate "
        "{s['hit_rate']:.0%}  \"\n"
        "      f\"{s['bytes_h2d'] / 2**20:.1f} MiB host->device  stall {s['stall_s'] * 1e3:.1f} ms  "
        "evictions {s['evictions']}\")"
    ),
    new_markdown_cell(
        "## Policies and chunk sizes\n"
        "Every chunk visits the layers in the same cycle, so with a budget below the whole model the "
        "recency/frequency policies (`lru`, `slru`, `lfu`) would evict each expert just before its next "
        "use (0% hits), so in whole-layer mode they release each layer after use like `stream` (and run "
        "as fast as it), while exact mode with small chunks keeps what the routing reuses; `static` pins "
        "whole layers spread over the depth up to the budget (what engines with per-layer pinning do; "
        "spread, so that streamed layers copy beside pinned layers' compute), and `stream` keeps "
        "nothing. Small chunks need only the routed experts (exact mode, router prefetch); large chunks "
        "need every expert of a layer (whole-layer streaming: the next layers' host parts are copied "
        "inside the mixer and experts programs, two layers ahead)."
    ),
    new_code_cell(
        "for chunk in (8, 128):\n"
        "    for policy in ('lru', 'slru', 'lfu', 'static', 'stream'):\n"
        "        r = OffloadedRunner(model, OffloadConfig(expert_budget=budget, cache_policy=policy), "
        "host_experts=host)\n"
        "        hybridlm.prefill(r, ids, chunk_size=chunk)\n"
        "        s = r.stats()['prefill']\n"
        "        per_layer = ' '.join(f\"{l['hit_rate']:4.0%}\" for l in s['per_layer'])\n"
        "        print(f\"chunk {chunk:3d} {policy:6s} hit rate {s['hit_rate']:4.0%}  \"\n"
        "              f\"{s['bytes_h2d'] / 2**20:6.1f} MiB moved  per layer: {per_layer}\")"
    ),
    new_markdown_cell(
        "## Decode reads the same cache\n"
        "Each decode step is one program: the device picks every routed expert from the cache (set after "
        "the prefill\n"
        "to whole layers, as many as the budget holds) or reads it straight from pinned host memory, "
        "with no ids going\n"
        "back to the host. `decode_paging='host'` steps layer by layer instead, paging misses into the "
        "cache with the\n"
        "policy. Both give the all-resident model's tokens.\n"
        "\n"
        "The host keeps each layer's experts in `host_parts` pinned buffers (4 by default, so that a "
        "whole-layer prefill can\n"
        "spread a layer's copy over several programs). `OffloadConfig(host_parts=1)` keeps one a layer: "
        "a decode\n"
        "copy then needs no control flow (on an H100, 4-bit, 12 GiB: 88 against 61-71 tokens/s), and a "
        "32k-token prefill\n"
        "runs 9% slower (`docs/offload.md`)."
    ),
    new_code_cell(
        "out = hybridlm.generate(runner, ids[:64], max_new_tokens=8, seed=0)\n"
        "d = runner.stats()['decode']\n"
        "print(out.tokens[0], f\"decode hit rate {d['hit_rate']:.0%}, experts read from host "
        "{d['misses']}\")\n"
        "by_layer = OffloadedRunner(model, OffloadConfig(expert_budget=budget, cache_policy='slru', "
        "decode_paging='host'),\n"
        "                           host_experts=host)\n"
        "ref = hybridlm.generate(hybridlm.LayerwiseRunner(model), ids[:64], max_new_tokens=8, seed=0)\n"
        "assert (out.tokens == ref.tokens).all()\n"
        "assert (hybridlm.generate(by_layer, ids[:64], max_new_tokens=8, seed=0).tokens == "
        "ref.tokens).all()\n"
        "assert np.isfinite(np.asarray(out.prefill.logits)).all()\n"
        "one_part = OffloadedRunner(model, OffloadConfig(expert_budget=budget, cache_policy='slru', "
        "host_parts=1))\n"
        "assert (hybridlm.generate(one_part, ids[:64], max_new_tokens=8, seed=0).tokens == "
        "ref.tokens).all()"
    ),
]

NOTEBOOKS = {"01_quickstart.ipynb": CELLS, "02_expert_offload.ipynb": OFFLOAD_CELLS}


def main():
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(
            cells=cells,
            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        )
        path = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / name
        nbformat.write(nb, path)
        print("wrote", path)


if __name__ == "__main__":
    main()
