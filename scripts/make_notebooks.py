"""Writes notebooks/01_quickstart.ipynb from the cells below (run: python scripts/make_notebooks.py)."""

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("# hybridlm quickstart\n\nBuild a model, ingest a prompt with chunked prefill (time to first "
                      "token), look at where the time goes, and generate. Runs on CPU in about a minute with the "
                      "`tiny` preset; on a GPU pick a real preset or `hybridlm.load(path)` a checkpoint."),
    new_code_cell("import jax, jax.numpy as jnp, numpy as np\nimport hybridlm\n"
                  "print('JAX', jax.__version__, 'on', jax.devices()[0].device_kind)"),
    new_markdown_cell("## A model\n`get_config` has the published presets (`qwen3.5-35b-a3b`, `qwen3.6-35b-a3b`, "
                      "`qwen3-next-80b-a3b`) and `tiny`: same architecture and full vocabulary, small everything "
                      "else. `init_random` gives random weights; `hybridlm.load(path)` reads an HF checkpoint "
                      "directory or a GGUF file."),
    new_code_cell("config = hybridlm.get_config('tiny')\n"
                  "print(config.layer_types)\n"
                  "print(f'{config.num_params() / 1e6:.1f} M parameters')\n"
                  "model = hybridlm.init_random(config, seed=0)"),
    new_markdown_cell("Loading a checkpoint works the same way; here one of the small HF test checkpoints:"),
    new_code_cell("import pathlib\n"
                  "ckpt = pathlib.Path('..') / 'tests' / 'fixtures' / 'hf' / 'qwen35moe_text'\n"
                  "if ckpt.exists():\n"
                  "    small = hybridlm.load(ckpt)\n"
                  "    logits = small(jnp.arange(10)[None])          # [batch, seq, vocab]\n"
                  "    print(small.config.name, logits.shape)"),
    new_markdown_cell("## Prefill\nThe prompt is tokenized with the real Qwen3.5/3.6 tokenizer and ingested in "
                      "chunks; the state (GDN recurrent + conv state, KV cache) is carried between chunks."),
    new_code_cell("from hybridlm.tokenizer import default_prompt\n"
                  "tokenizer = hybridlm.Tokenizer()\n"
                  "ids = tokenizer.encode(default_prompt())\n"
                  "runner = hybridlm.LayerwiseRunner(model)      # compiled functions are reused across calls\n"
                  "hybridlm.prefill(runner, ids, chunk_size=1024)   # first call compiles\n"
                  "result = hybridlm.prefill(runner, ids, chunk_size=1024)\n"
                  "print(f'{result.prompt_tokens} tokens in {result.num_chunks} chunks: TTFT {result.ttft_s:.2f} s, '\n"
                  "      f'{result.tokens_per_s:.0f} tokens/s')"),
    new_markdown_cell("## Where the time goes\n`profile=True` synchronises after every phase and sums wall time per "
                      "phase (it removes overlap, so use it to compare phases, not for TTFT)."),
    new_code_cell("profiled = hybridlm.prefill(runner, ids, chunk_size=1024, profile=True)\n"
                  "for phase, seconds in profiled.phase_seconds.items():\n"
                  "    print(f'{phase:10s} {seconds * 1e3:8.1f} ms')"),
    new_markdown_cell("## Generate\nGreedy by default; `temperature`, `top_k`, `top_p` and `seed` for sampling. "
                      "(Random weights produce random text.)"),
    new_code_cell("out = hybridlm.generate(runner, ids[:200], max_new_tokens=8, temperature=0.8, top_p=0.95, seed=0)\n"
                  "print(out.tokens, repr(tokenizer.decode(out.tokens[0])))\n"
                  "assert np.isfinite(np.asarray(out.prefill.logits)).all()"),
]


def main():
    nb = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    path = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"
    nbformat.write(nb, path)
    print("wrote", path)


if __name__ == "__main__":
    main()
