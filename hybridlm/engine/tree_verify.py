"""Tree verification through the hybrid model: every node of a token tree in one forward, then the commit of
the accepted path (the target side of DDTree).

One round, root token t (the last emitted token) at position p, a drafter's per-position logits:

    tree   = build_tree(t, draft_logits, budget)                 # DDTree's best-first tree, `tree.py`
    H, S   = verify_tree(model, states, tree, p)                 # one forward over the nodes
             # Gated DeltaNet: node i's state from its parent's (the root's from the incoming state);
             # attention: node i at p + depth[i], seeing the cache [0, p) and its ancestors; nothing written
    path   = accept (greedy: follow the target's argmax; sampling: one target draw per node), `spec_sampling`
    states = commit_tree(S, path, n, p)                          # GDN: the last accepted node's slot;
             # attention: the path's keys/values written at p .. p + n
    emit   = the n accepted drafts, then the target's token at the last accepted node

Source: DDTree (Ringel, Romano, arXiv:2604.12989); SpecInfer (Miao et al., arXiv:2305.09781) for tree
attention; the chain form and its rollback by state slot: `speculative.py`. Batch 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hybridlm.engine.spec_sampling import accept_tree, accept_tree_greedy, filtered_probs
from hybridlm.engine.tree import TokenTree, ancestor_mask, build_tree
from hybridlm.model import check_taps, concat_taps
from hybridlm.state import KVCache, LayerState, TreeKV


def verify_tree(
    model, states: list, tokens, parents, depth, position, valid=None, taps: tuple[int, ...] = ()
):
    """The model over the nodes of a token tree in one forward (a tree verify).

    Args:
      model: a `HybridLM` (or a module with its `embed` and `layers`).
      states: per-layer states holding positions [0, position).
      tokens: [1, nodes] int32, the nodes' tokens (node 0 the root, at `position`).
      parents: [nodes] int32, -1 at the root, parents[i] < i (`tree.check_tree` checks host arrays).
      depth: [nodes] int32, 0 at the root; node i sits at position + depth[i].
      position: int32 scalar (may be traced), the root's absolute position.
      valid: [nodes] bool or None; padding nodes get no routed experts (their outputs are never read).
      taps: layer indices whose outputs are also returned (a DFlash draft's context rows).

    Returns:
      hidden [1, nodes, hidden] before the final norm, and the per-layer tree states: a
      `GatedDeltaNetState` with a leading [nodes] axis (entry i: after node i's root path) on Gated DeltaNet
      layers, a `TreeKV` (the cache unchanged, the nodes' keys and values) on attention layers; with `taps`,
      a third value: the features [1, nodes, len(taps) * hidden] (`model.concat_taps`).

    Raises:
      ValueError: tokens, parents and depth of different node counts, or a tap outside the model's layers.
    """
    nodes = parents.shape[0]
    if tokens.shape != (1, nodes) or depth.shape != (nodes,):
        raise ValueError(
            f"expected tokens [1, nodes] and depth [nodes] for parents of {nodes} nodes, got {tokens.shape} "
            f"and {depth.shape}"
        )
    taps = check_taps(taps, len(model.layers))
    ancestors = ancestor_mask(parents)
    rows = None if valid is None else valid[None]
    x = model.embed[...][tokens]
    new_states, tapped = [], {}
    for i, (layer, state) in enumerate(zip(model.layers, states, strict=True)):
        x, state = layer.verify_tree(x, state, position, parents, depth, ancestors, rows)
        new_states.append(state)
        if i in taps:
            tapped[i] = x
    return (x, new_states, concat_taps(tapped, taps)) if taps else (x, new_states)


def commit_tree(tree_states: list, path: jax.Array, num_accepted, position) -> list[LayerState]:
    """The layer states after the accepted path of a tree verify: as if the path's n + 1 tokens had gone
    through the model as a chain.

    Gated DeltaNet layers take the last accepted node's slot (no recompute: `verify_tree` kept every node's
    state). Attention layers write the path's keys and values at positions position .. position + n; rows of
    `path` past n write nothing (no stale entries, and no clamped write near the cache's end).

    Args:
      tree_states: what `verify_tree` returned.
      path: [path_len] int32, the accepted nodes from the root (`spec_sampling.follow_tree`).
      num_accepted: int32 scalar n < path_len.
      position: the root's absolute position (as given to `verify_tree`).

    Returns:
      Per-layer states holding positions [0, position + n + 1): `GatedDeltaNetState` and `KVCache`.
    """
    last = path[num_accepted]
    out = []
    for state in tree_states:
        if isinstance(state, TreeKV):
            out.append(_write_path(state, path, num_accepted, position))
        else:
            out.append(jax.tree_util.tree_map(lambda a: a[last], state))
    return out


def _write_path(state: TreeKV, path, num_accepted, position) -> KVCache:
    cache = state.cache
    row = jnp.arange(path.shape[0], dtype=jnp.int32)
    at = jnp.where(row <= num_accepted, position + row, cache.capacity)  # past the cache: dropped
    return KVCache(
        key=cache.key.at[:, at].set(state.key[:, path].astype(cache.key.dtype), mode="drop"),
        value=cache.value.at[:, at].set(state.value[:, path].astype(cache.value.dtype), mode="drop"),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeRound:
    """What one tree round (`tree_round`) gives."""

    emitted: jax.Array  # [depth_limit + 1] int32: the accepted drafts then the target's token, 0 past count
    count: jax.Array  # int32: n + 1 tokens emitted (n accepted drafts)
    states: list  # the layer states holding positions [0, position + count)
    path_hidden: jax.Array  # [depth_limit + 1, hidden]: the model's pre-final-norm states along the path
    tree: TokenTree  # the verified tree
    path: jax.Array  # [depth_limit + 1] int32: the accepted nodes from the root, 0 past n


def tree_round(
    model,
    states: list,
    root_token,
    draft_logits: jax.Array,
    position,
    *,
    budget: int,
    key: jax.Array | None = None,
    temperature=1.0,
    top_p=1.0,
    top_k: int = 0,
) -> TreeRound:
    """One DDTree round: build the tree from the drafter's logits, verify it in one forward, accept, commit.

    Args:
      model: a bound speculative target (`ResidentTarget.bind(...)`, `OffloadTarget.bind(...)`: `verify_tree`
        and `logits`).
      states: per-layer states holding positions [0, position); the KV cache must hold position +
        depth_limit + 1 positions (rows past it are dropped).
      root_token: int32 scalar, the last emitted token, at `position`.
      draft_logits: [depth_limit, vocab] float, the drafter's logits for the tokens after the root.
      position: int32 scalar.
      budget: tree nodes besides the root (static).
      key: None for greedy acceptance; else a PRNG key: lossless sampling (`spec_sampling.accept_tree`) from
        the target's distribution at `temperature`, `top_p` (traced is fine) and `top_k` (static).

    Returns:
      A `TreeRound`.
    """
    depth_limit = draft_logits.shape[0]
    tree = build_tree(root_token, draft_logits, budget)
    hidden, tree_states = model.verify_tree(
        states, tree.tokens[None], tree.parents, tree.depth, position, tree.valid
    )
    logits = model.logits(hidden[0])  # [nodes, vocab] float32
    if key is None:
        path, n, nxt = accept_tree_greedy(logits, tree.tokens, tree.parents, tree.valid, depth_limit)
    else:
        probs = filtered_probs(logits, temperature, top_k, top_p)
        path, n, nxt = accept_tree(probs, tree.tokens, tree.parents, tree.valid, key, depth_limit)
    row = jnp.arange(depth_limit + 1)
    drafts = jnp.append(tree.tokens[path[1:]], 0)  # draft r is the node at path[r + 1]
    emitted = jnp.where(row < n, drafts, jnp.where(row == n, nxt, 0)).astype(jnp.int32)
    return TreeRound(
        emitted=emitted,
        count=n + 1,
        states=commit_tree(tree_states, path, n, position),
        path_hidden=hidden[0, path],
        tree=tree,
        path=path,
    )
