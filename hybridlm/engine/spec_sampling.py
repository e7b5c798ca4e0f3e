"""Speculative decoding's acceptance rule: which drafted tokens the target keeps, and the token after them.

Pure, jittable and batch-aware: static shapes, no Python branch on a traced value, no host transfer, so a
speculative decode loop runs draft, verify and acceptance as one program per iteration.

Dims: batch; draft = k, the drafted tokens per row; draft + 1 = the verified positions (position i predicts
the token after draft i, position 0 the one after the last emitted token); vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridlm.engine.sampling import check_sampling, filter_logits, is_greedy, nucleus_applies


def filtered_probs(
    logits: jax.Array,
    temperature: float | jax.Array,
    top_k: int = 0,
    top_p: float | jax.Array = 1.0,
) -> jax.Array:
    """The distribution `sampling.sample` draws from at these settings, as probabilities.

    Temperature scaling, top-k and nucleus top-p filter as `sample` does (`sampling.filter_logits`); at a
    temperature of 0 (Python or array) the distribution is one-hot at the argmax, `sample`'s greedy token.

    Args:
      logits: [..., vocab] float32.
      temperature: scalar >= 0; may be traced.
      top_k: keep the top_k most likely tokens (0: all); static.
      top_p: nucleus mass in (0, 1]; may be traced (a Python 1 skips the filter, as `sample` does).

    Returns:
      [..., vocab] float32, each row summing to 1 (zeros outside the support).

    Raises:
      ValueError: a Python setting out of range (`sampling.check_sampling`).
    """
    check_sampling(temperature, top_k, top_p)
    logits = logits.astype(jnp.float32)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    if is_greedy(temperature):
        return greedy
    scaled = filter_logits(logits, temperature, top_p, top_k=top_k, nucleus=nucleus_applies(top_p))
    return jnp.where(jnp.asarray(temperature) > 0, jax.nn.softmax(scaled, axis=-1), greedy)


def accept_drafts(
    target_probs: jax.Array, draft_probs: jax.Array, draft_tokens: jax.Array, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Speculative rejection sampling: the emitted tokens are distributed as sampling from the target alone.

    Draft i (x_i drawn from q_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)) while every earlier
    draft was accepted. At the first rejection j the next token is drawn from norm(max(0, p_j - q_j)); if all
    k are accepted, the bonus token is drawn from p_k. Degenerate inputs stay finite: a draft with
    p_i(x_i) = q_i(x_i) = 0 is rejected, and a residual with no mass (rounding) falls back to p_j.
    Source: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding",
    arXiv:2211.17192, Algorithm 1; Chen et al., arXiv:2302.01318, Algorithm 2.

    Args:
      target_probs: [batch, draft + 1, vocab] float32, the target's filtered distribution (`filtered_probs`)
        at each verified position.
      draft_probs: [batch, draft, vocab] float32, the drafter's filtered distribution draft i was drawn from.
      draft_tokens: [batch, draft] int32 in [0, vocab).
      key: PRNG key.

    Returns:
      num_accepted: [batch] int32 in [0, draft], the accepted prefix length.
      next_token: [batch] int32, the token emitted after the accepted drafts (residual or bonus sample).

    Raises:
      ValueError: shapes that disagree.
    """
    batch, num_draft = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape != (batch, num_draft + 1, vocab) or draft_probs.shape != (batch, num_draft, vocab):
        raise ValueError(
            f"expected target_probs [batch, draft + 1, vocab] and draft_probs [batch, draft, vocab] for "
            f"draft_tokens {draft_tokens.shape}, got {target_probs.shape} and {draft_probs.shape}"
        )
    target_probs = target_probs.astype(jnp.float32)
    draft_probs = draft_probs.astype(jnp.float32)
    accept_key, residual_key = jax.random.split(key)
    tokens = draft_tokens.astype(jnp.int32)[..., None]
    p = jnp.take_along_axis(target_probs[:, :num_draft], tokens, axis=-1)[..., 0]  # [batch, draft]
    q = jnp.take_along_axis(draft_probs, tokens, axis=-1)[..., 0]
    u = jax.random.uniform(accept_key, (batch, num_draft), jnp.float32)
    # u < p / q without the division; p >= q accepts surely (u * q may round up to q), unless p = q = 0.
    accepted = (u * q < p) | ((p >= q) & (p > 0))
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)

    # The bonus position has no draft: a zero q there makes the residual p_k itself.
    padded_draft = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))
    at = num_accepted[:, None, None]
    p_j = jnp.take_along_axis(target_probs, at, axis=1)[:, 0]  # [batch, vocab]
    q_j = jnp.take_along_axis(padded_draft, at, axis=1)[:, 0]
    residual = jnp.maximum(p_j - q_j, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_j)
    next_token = jax.random.categorical(residual_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return num_accepted, next_token


def accept_greedy(target_logits: jax.Array, draft_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy verification: the longest draft prefix equal to the target's argmax, then the target's argmax.

    The emitted tokens are those of plain greedy decoding (argmax ties resolve to the lowest id, as
    `sampling.sample` does).

    Args:
      target_logits: [batch, draft + 1, vocab] float, the target's logits at each verified position.
      draft_tokens: [batch, draft] int32.

    Returns:
      num_accepted: [batch] int32 in [0, draft].
      next_token: [batch] int32, the target's argmax at position num_accepted.

    Raises:
      ValueError: shapes that disagree.
    """
    batch, num_draft = draft_tokens.shape
    if target_logits.shape[:2] != (batch, num_draft + 1):
        raise ValueError(
            f"expected target_logits [batch, draft + 1, vocab] for draft_tokens {draft_tokens.shape}, "
            f"got {target_logits.shape}"
        )
    greedy = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [batch, draft + 1]
    matches = (greedy[:, :num_draft] == draft_tokens).astype(jnp.int32)
    num_accepted = jnp.sum(jnp.cumprod(matches, axis=-1), axis=-1).astype(jnp.int32)
    next_token = jnp.take_along_axis(greedy, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token


def follow_tree(
    target_tokens: jax.Array,
    node_tokens: jax.Array,
    parents: jax.Array,
    valid: jax.Array,
    max_depth: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walks a verified token tree from the root: while the target's token at the current node is the token
    of one of its (valid) children, move there; the target's token at the last node reached comes next.

    Source: DDTree (Ringel, Romano, arXiv:2604.12989), the reference's `follow_verified_tree`; SpecInfer's
    token-tree verification (Miao et al., arXiv:2305.09781, §4.3).

    Args:
      target_tokens: [nodes] int32, the target's token at each node (its argmax, or one sample per node).
      node_tokens: [nodes] int32; parents: [nodes] int32 (-1 at the root); valid: [nodes] bool (a
        `TokenTree`'s fields). Siblings' tokens are distinct (the first match wins otherwise).
      max_depth: the tree's largest depth (static; None: nodes - 1).

    Returns:
      path: [max_depth + 1] int32, the accepted nodes from the root (path[0] = 0), 0 past num_accepted.
      num_accepted: int32, the accepted drafts n (path[n] is the last accepted node).
      next_token: int32, the target's token at path[n].
    """
    nodes = node_tokens.shape[0]
    max_depth = nodes - 1 if max_depth is None else max_depth

    def step(depth, carry):
        node, count, path = carry
        match = valid & (parents == node) & (node_tokens == target_tokens[node])
        go = jnp.any(match) & (count == depth)  # still on the tree
        child = jnp.argmax(match).astype(jnp.int32)
        return jnp.where(go, child, node), count + go, path.at[depth + 1].set(jnp.where(go, child, 0))

    start = (jnp.int32(0), jnp.int32(0), jnp.zeros((max_depth + 1,), jnp.int32))
    node, count, path = jax.lax.fori_loop(0, max_depth, step, start)
    return path, count, target_tokens[node]


def accept_tree_greedy(
    target_logits: jax.Array,
    node_tokens: jax.Array,
    parents: jax.Array,
    valid: jax.Array,
    max_depth: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy tree verification: from the root, follow the child whose token is the target's argmax at the
    current node; emit the accepted drafts, then the argmax at the last accepted node (plain greedy
    decoding's tokens; ties to the lowest id, as `accept_greedy`).

    Args:
      target_logits: [nodes, vocab] float, the target's logits at each node (`tree_verify.verify_tree`).
      node_tokens, parents, valid, max_depth: the tree, as `follow_tree` takes it.

    Returns:
      (path [max_depth + 1] int32, num_accepted int32, next_token int32), as `follow_tree`.

    Raises:
      ValueError: target_logits not [nodes, vocab].
    """
    if target_logits.ndim != 2 or target_logits.shape[0] != node_tokens.shape[0]:
        raise ValueError(
            f"expected target_logits [nodes, vocab] for {node_tokens.shape[0]} nodes, "
            f"got {target_logits.shape}"
        )
    greedy = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    return follow_tree(greedy, node_tokens, parents, valid, max_depth)


def accept_tree(
    target_probs: jax.Array,
    node_tokens: jax.Array,
    parents: jax.Array,
    valid: jax.Array,
    key: jax.Array,
    max_depth: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Lossless sampling on a token tree: one token x_i ~ p_i drawn at every node, then `follow_tree`: move to
    the child carrying x, else stop and emit x.

    Each emitted token is a sample of the target given its prefix: the draw at a node the walk reaches is
    independent of the walk so far, and the walk goes on exactly when that draw is a child's token. The
    drafter's probabilities play no part (the tree is a set of guesses; unlike `accept_drafts`, no residual
    is needed because a miss emits the target's own draw). Source: DDTree (Ringel, Romano, arXiv:2604.12989),
    the reference's `follow_verified_tree` over per-node samples; compare SpecInfer's multi-step speculative
    sampling (Miao et al., arXiv:2305.09781, §4.3) and Leviathan et al. (arXiv:2211.17192).

    Args:
      target_probs: [nodes, vocab] float32, the target's filtered distribution at each node
        (`filtered_probs`).
      node_tokens, parents, valid, max_depth: the tree, as `follow_tree` takes it.
      key: PRNG key.

    Returns:
      (path [max_depth + 1] int32, num_accepted int32, next_token int32), as `follow_tree`.

    Raises:
      ValueError: target_probs not [nodes, vocab].
    """
    if target_probs.ndim != 2 or target_probs.shape[0] != node_tokens.shape[0]:
        raise ValueError(
            f"expected target_probs [nodes, vocab] for {node_tokens.shape[0]} nodes, got {target_probs.shape}"
        )
    draws = jax.random.categorical(key, jnp.log(target_probs.astype(jnp.float32)), axis=-1).astype(jnp.int32)
    return follow_tree(draws, node_tokens, parents, valid, max_depth)
