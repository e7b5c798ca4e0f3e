"""Block speculative decoding with a DFlash draft (`generate(..., speculative="dflash" | "ddtree")`) on tiny
float32 models of both architectures: greedy output equals plain greedy decoding while drafts are accepted,
rejected and (trees) taken from a second-ranked candidate; oracle acceptance is the rate asked for; sampling
is seeded and finite; offloaded experts give the resident tokens ("auto" decodes them plainly); bad requests
get one clear error.

A random draft accepts almost nothing, so `Peeking` (a `DFlashDraft` whose logits are nudged towards the
plain greedy text at most positions, towards a wrong token as its top candidate at others) makes the verify
accept, reject and branch for real."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import assert_finite

import hybridlm
from hybridlm.dflash import DFlashConfig, DFlashDraft, init_random_dflash

CHUNK = 16
NEW = 20
PROMPT = 9
BLOCK = 4
BUDGET = 6
REFERENCE_LENGTH = 64

TINY_35 = hybridlm.get_config("tiny")
TINY_NEXT = TINY_35.replace(
    name="tiny-next",
    vocab_size=4096,
    attention=dataclasses.replace(TINY_35.attention, mrope_sections=None),
)
ARCHS = {"qwen3.5": TINY_35, "qwen3-next": TINY_NEXT}


class Peeking(DFlashDraft):
    """A DFlash draft whose logits lean to the reference text (prompt + plain greedy tokens by position):
    the reference token gets +50 at positions p with p % 4 != 3; at the others a wrong token gets +50 and the
    reference token +40 (second rank: a tree finds it, a chain does not)."""

    def draft(self, block_embeddings, cache, start, head_weight):
        hidden, logits = super().draft(block_embeddings, cache, start, head_weight)
        ref = self.reference[...]
        pos = start + 1 + jnp.arange(logits.shape[1])  # the positions the logits predict
        want = ref[jnp.minimum(pos, ref.shape[0] - 1)]
        wrong = (want + 1) % logits.shape[-1]
        second = pos % 4 == 3
        boost = jax.nn.one_hot(want, logits.shape[-1]) * jnp.where(second, 40.0, 50.0)[:, None]
        boost = boost + jax.nn.one_hot(wrong, logits.shape[-1]) * jnp.where(second, 50.0, 0.0)[:, None]
        return hidden, logits + boost[None]


def peeking_draft(config: DFlashConfig, reference: np.ndarray, seed: int) -> Peeking:
    base = init_random_dflash(config, seed=seed)
    peeking = nnx.eval_shape(lambda: Peeking(config, rngs=nnx.Rngs(0)))
    nnx.update(peeking, nnx.state(base))
    peeking.reference = nnx.Variable(jnp.asarray(reference, jnp.int32))
    return peeking


@pytest.fixture(scope="module")
def cases():
    """arch -> (runner, random draft, peeking draft, prompt [PROMPT], plain greedy tokens [NEW])."""
    built = {}
    for arch, config in ARCHS.items():
        model = hybridlm.init_random(config, seed=3)
        runner = hybridlm.LayerwiseRunner(model)
        prompt = np.random.default_rng(7).integers(0, config.vocab_size, PROMPT).astype(np.int32)
        plain = hybridlm.generate(runner, prompt, max_new_tokens=NEW + BLOCK, chunk_size=CHUNK)
        reference = np.zeros(REFERENCE_LENGTH, np.int32)
        reference[: PROMPT + NEW + BLOCK] = np.concatenate([prompt, plain.tokens[0]])
        dconfig = DFlashConfig.tiny_for(config, block_size=BLOCK)
        built[arch] = (
            runner,
            init_random_dflash(dconfig, seed=11),
            peeking_draft(dconfig, reference, seed=11),
            prompt,
            plain.tokens[:, :NEW],
        )
    return built


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_plain_decoding(cases, arch, method):
    runner, _, peeking, prompt, plain = cases[arch]
    g = hybridlm.generate(
        runner,
        prompt,
        max_new_tokens=NEW,
        chunk_size=CHUNK,
        speculative=method,
        draft=peeking,
        tree_budget=BUDGET,
    )
    np.testing.assert_array_equal(g.tokens, plain)
    stats = g.speculative
    assert stats["method"] == method and stats["iterations"] >= 1
    # the peeking draft is right at 3 positions of 4 as top candidate: the chain accepts some, the tree more
    # (the second-ranked candidates too)
    assert 1.0 < stats["tokens_per_iteration"] <= BLOCK
    if method == "ddtree":
        assert stats["tokens_per_iteration"] > 2.0


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_one_new_token_is_the_prefill_token(cases, method):
    """max_new_tokens=1 runs no block: the prefill's token, and statistics of zero iterations."""
    runner, random_draft, _, prompt, plain = cases["qwen3.5"]
    g = hybridlm.generate(
        runner, prompt, max_new_tokens=1, chunk_size=CHUNK, speculative=method, draft=random_draft
    )
    np.testing.assert_array_equal(g.tokens, plain[:, :1])
    assert g.stop_reason == "length" and g.speculative["iterations"] == 0


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_oracle_acceptance_all_or_nothing(cases, method):
    """alpha = 1: every iteration accepts the whole block (B tokens); alpha = 0: one token each."""
    runner, random_draft, _, prompt, _ = cases["qwen3.5"]
    kw = dict(
        max_new_tokens=NEW, chunk_size=CHUNK, speculative=method, draft=random_draft, tree_budget=BUDGET
    )
    full = hybridlm.generate(runner, prompt, oracle_draft=(None, 1.0), **kw).speculative
    none = hybridlm.generate(runner, prompt, oracle_draft=(None, 0.0), **kw).speculative
    assert full["tokens_per_iteration"] == pytest.approx(BLOCK, abs=0.5)  # the last iteration may be cut
    assert none["tokens_per_iteration"] == 1.0 and none["mean_accepted"] == 0.0


def test_sampling_is_seeded_and_finite(cases):
    runner, _, peeking, prompt, _ = cases["qwen3-next"]
    kw = dict(max_new_tokens=NEW, chunk_size=CHUNK, temperature=0.8, top_k=20, seed=4, draft=peeking)
    a = hybridlm.generate(runner, prompt, speculative="ddtree", tree_budget=BUDGET, **kw)
    b = hybridlm.generate(runner, prompt, speculative="ddtree", tree_budget=BUDGET, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.tokens.shape == (1, NEW) and (a.tokens >= 0).all()
    assert a.speculative["iterations"] >= 1 and a.speculative["tokens_per_iteration"] >= 1.0
    assert_finite(a.prefill.logits, "prefill logits")


def test_offloaded_experts_give_the_resident_tokens(cases):
    from hybridlm.offload import HostExperts, OffloadConfig, OffloadedRunner
    from hybridlm.offload.decode import IN_HOST, IN_POOL

    runner, _, peeking, prompt, plain = cases["qwen3.5"]
    host = HostExperts.from_model(runner.model, parts=1)
    off = OffloadedRunner(runner.model, OffloadConfig(expert_budget="3MiB"), host_experts=host)
    for method in ("dflash", "ddtree"):
        g = hybridlm.generate(
            off,
            prompt,
            max_new_tokens=NEW,
            chunk_size=CHUNK,
            speculative=method,
            draft=peeking,
            tree_budget=BUDGET,
        )
        np.testing.assert_array_equal(g.tokens, plain)
    assert {IN_HOST, IN_POOL} <= set(off.decoder.view.sources)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"speculative": "ddtree"}, "needs its drafter as draft="),
        ({"speculative": "ddtree", "tree_budget": 0}, "tree_budget"),
        ({"speculative": "dflash", "oracle_draft": (None, 0.5), "temperature": 0.5}, "greedy"),
    ],
)
def test_refusals(cases, kw, match):
    runner, random_draft, _, prompt, _ = cases["qwen3.5"]
    if "tree_budget" in kw or "oracle_draft" in kw:
        kw = {**kw, "draft": random_draft}
    with pytest.raises(ValueError, match=match):
        hybridlm.generate(runner, prompt, max_new_tokens=4, chunk_size=CHUNK, **kw)


def test_draft_of_another_model_is_refused(cases):
    runner, _, _, prompt, _ = cases["qwen3.5"]
    other = init_random_dflash(DFlashConfig.tiny_for(TINY_NEXT, block_size=BLOCK), seed=1)
    with pytest.raises(ValueError, match="vocab"):
        hybridlm.generate(runner, prompt, max_new_tokens=4, speculative="dflash", draft=other)
