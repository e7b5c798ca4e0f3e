"""Token trees for tree speculative decoding: the structure, its ancestor mask, and DDTree's construction.

A tree of `nodes` entries in topological order: node 0 is the root (the last emitted token, at the position
the verify starts from), `parents[i] < i` for every other node, `depth[i]` its distance from the root. The
number of nodes is static (padding nodes are marked invalid), so that a decode loop compiles once.

Construction (`build_tree`) follows DDTree (Ringel, Romano, "Accelerating Speculative Decoding with Block
Diffusion Draft Trees", arXiv:2604.12989; reference code: `build_ddtree_tree` of
github.com/liranringel/ddtree): a block drafter gives one distribution per position d (the token at depth
d + 1), independent of the tokens before it; a path's score is the sum of its tokens' log-probabilities; a
best-first heap pops the best candidate prefix, adds it as a node and pushes its next-ranked sibling and its
first child, until `budget` nodes are placed. Every candidate scores no more than the prefix that pushed it
(log-probabilities are <= 0 and each position's candidates are ranked), so the nodes are the `budget`
highest-scoring prefixes of the top-k product tree, in descending order of score. `build_tree` runs that
loop on the device with static shapes (`build_tree_host` is the same algorithm with Python's heapq, the
oracle of the tests).

Dims: nodes = budget + 1; depth_limit = L, the drafter's positions; top_k = candidates per position.
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenTree:
    """A token tree of static size (batch 1): node 0 is the root; padding nodes are children of the root
    marked invalid."""

    tokens: jax.Array  # [nodes] int32: the token at each node (node 0: the root token)
    parents: jax.Array  # [nodes] int32: each node's parent, -1 at the root; parents[i] < i
    depth: jax.Array  # [nodes] int32: 0 at the root; the node's position is the root's + depth
    valid: jax.Array  # [nodes] bool: False for padding nodes (a budget larger than the candidates)
    score: jax.Array  # [nodes] float32: the path's summed drafter log-probability (0 at the root)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[-1]

    def ancestors(self) -> jax.Array:
        """[nodes, nodes] bool, the ancestor-only attention mask (`ancestor_mask`)."""
        return ancestor_mask(self.parents)


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """Which nodes each node sees in a tree verify: itself and its ancestors (SpecInfer's topology-aware
    causal mask, Miao et al., arXiv:2305.09781 §4.2; DDTree's ancestor-only mask).

    Args:
      parents: [nodes] int32, -1 at the root, parents[i] < i (topological order: each row is its parent's
        row plus itself, built in one pass).

    Returns:
      [nodes, nodes] bool: mask[i, j] iff j == i or j is an ancestor of i.
    """
    nodes = parents.shape[0]
    eye = jnp.eye(nodes, dtype=bool)

    def row(i, mask):
        parent = parents[i]
        inherited = jnp.where(parent >= 0, mask[jnp.maximum(parent, 0)], False)
        return mask.at[i].set(inherited | eye[i])

    return jax.lax.fori_loop(0, nodes, row, eye)


def check_tree(parents, depth=None) -> None:
    """Raises ValueError unless host-side `parents` [nodes] (and `depth` [nodes], if given) describe a tree in
    topological order rooted at node 0: parents[0] == -1, 0 <= parents[i] < i, depth[i] = depth[parent] + 1.
    Traced arrays cannot be checked; the verify trusts them."""
    parents = np.asarray(parents)
    if parents.ndim != 1 or parents.size == 0 or parents[0] != -1:
        raise ValueError(f"parents must be [nodes] with parents[0] == -1 (the root), got {parents}")
    index = np.arange(parents.size)
    bad = (parents[1:] < 0) | (parents[1:] >= index[1:])
    if bad.any():
        raise ValueError(f"parents must satisfy 0 <= parents[i] < i; nodes {index[1:][bad]} do not")
    if depth is not None:
        depth = np.asarray(depth)
        want = np.zeros_like(depth)
        for i in range(1, parents.size):
            want[i] = want[parents[i]] + 1
        if depth.shape != parents.shape or (depth != want).any():
            raise ValueError(f"depth {depth} disagrees with parents (expected {want})")


def draft_top_k(draft_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Each drafter position's k most likely tokens.

    Args:
      draft_logits: [depth_limit, vocab] float logits (or log-probabilities) of the drafter, row d for the
        token at depth d + 1; each row needs one finite entry.
      k: candidates per position, 1 <= k <= vocab.

    Returns:
      top_log_probs [depth_limit, k] float32 (log_softmax, descending; ties: lower token id first) and
      top_tokens [depth_limit, k] int32.
    """
    log_probs = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(log_probs, k)
    return values, ids.astype(jnp.int32)


def build_tree(root_token, draft_logits: jax.Array, budget: int, *, top_k: int | None = None) -> TokenTree:
    """DDTree's draft tree: the `budget` highest-scoring prefixes of the drafter's per-position top-k tokens.

    Best-first expansion (DDTree, Algorithm 1; see the module docstring): the heap starts with the top token
    at depth 1; each pop places a node and pushes its next-ranked sibling (same parent, rank + 1) and its
    first child (depth + 1, rank 0). Scores are summed drafter log-probabilities; ties go to the
    lexicographically smallest rank sequence, as the reference's heap keys (-score, ranks) order them. Here
    the heap is a fixed array of budget + 1 candidate slots (a pop frees its slot for the sibling, the child
    takes the next free one) and each of the `budget` steps is one argmax over it, so the whole construction
    is one `fori_loop` with static shapes. The sibling's score is the parent's score plus its log-probability
    (the reference subtracts the popped node's and adds the sibling's: equal in exact arithmetic, and free of
    -inf - -inf for tokens the drafter rules out).

    Args:
      root_token: int32 scalar (or [1]), the last emitted token.
      draft_logits: [depth_limit, vocab] float, the drafter's logits (or log-probabilities) per position,
        each position's distribution independent of the others (a block diffusion drafter's).
      budget: nodes to place besides the root (static); fewer when the top-k tree has fewer prefixes
        (sum of top_k^d, d = 1..depth_limit), the rest padding.
      top_k: candidates per position (static); None: min(budget, vocab), the reference's choice (more can
        never be placed).

    Returns:
      A `TokenTree` of budget + 1 nodes: node 0 the root, then the placed nodes in the order they were popped
      (descending score), then padding (invalid, children of the root with token 0 and score -inf).

    Raises:
      ValueError: draft_logits not [depth_limit, vocab], a negative budget, or top_k < 1.
    """
    if draft_logits.ndim != 2:
        raise ValueError(f"draft_logits must be [depth_limit, vocab], got shape {draft_logits.shape}")
    if budget < 0:
        raise ValueError(f"budget={budget} must be >= 0")
    depth_limit, vocab = draft_logits.shape
    k = min(budget, vocab) if top_k is None else min(top_k, vocab)
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    root = jnp.asarray(root_token, jnp.int32).reshape(())
    if budget == 0 or depth_limit == 0:
        return _root_only(root, budget + 1)
    top_log_probs, top_tokens = draft_top_k(draft_logits, k)
    return build_tree_from_top_k(root, top_log_probs, top_tokens, budget)


def build_tree_from_top_k(
    root_token, top_log_probs: jax.Array, top_tokens: jax.Array, budget: int
) -> TokenTree:
    """`build_tree` from each position's candidates already ranked (`draft_top_k`).

    Args:
      root_token: int32 scalar.
      top_log_probs: [depth_limit, top_k] float32, descending along top_k.
      top_tokens: [depth_limit, top_k] int32, distinct within a row.
      budget: nodes to place besides the root (static).

    Returns:
      A `TokenTree` of budget + 1 nodes, as `build_tree`.
    """
    depth_limit, k = top_log_probs.shape
    nodes = slots = budget + 1
    f32, i32 = jnp.float32, jnp.int32
    root = jnp.asarray(root_token, i32).reshape(())
    cand = _Candidates(
        valid=jnp.zeros((slots,), bool).at[0].set(True),
        score=jnp.full((slots,), -jnp.inf, f32).at[0].set(top_log_probs[0, 0]),
        base=jnp.zeros((slots,), f32),
        parent=jnp.zeros((slots,), i32),
        depth=jnp.ones((slots,), i32),
        rank=jnp.zeros((slots,), i32),
        ranks=jnp.full((slots, depth_limit), -1, i32).at[0, 0].set(0),
    )
    tree = _root_only(root, nodes)

    def pop(step, carry):
        c, t = carry
        j, live = _best(c)
        d, r, score, ranks = c.depth[j], c.rank[j], c.score[j], c.ranks[j]
        node = step + 1
        t = TokenTree(
            tokens=t.tokens.at[node].set(jnp.where(live, top_tokens[d - 1, r], 0)),
            parents=t.parents.at[node].set(jnp.where(live, c.parent[j], 0)),
            depth=t.depth.at[node].set(jnp.where(live, d, 1)),
            valid=t.valid.at[node].set(live),
            score=t.score.at[node].set(jnp.where(live, score, -jnp.inf)),
        )
        # the next-ranked sibling takes the popped slot; the first child the next free slot (step + 1)
        sib = jnp.minimum(r + 1, k - 1)
        c = c.put(
            j,
            valid=live & (r + 1 < k),
            score=c.base[j] + top_log_probs[d - 1, sib],
            base=c.base[j],
            parent=c.parent[j],
            depth=d,
            rank=r + 1,
            ranks=ranks.at[d - 1].set(r + 1),
        )
        deeper = jnp.minimum(d, depth_limit - 1)
        c = c.put(
            node,
            valid=live & (d < depth_limit),
            score=score + top_log_probs[deeper, 0],
            base=score,
            parent=node,
            depth=d + 1,
            rank=0,
            ranks=ranks.at[deeper].set(jnp.where(d < depth_limit, 0, ranks[deeper])),
        )
        return c, t

    return jax.lax.fori_loop(0, budget, pop, (cand, tree))[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Candidates:
    """The heap as fixed slots: candidate prefixes not yet placed (`build_tree_from_top_k`)."""

    valid: jax.Array  # [slots] bool
    score: jax.Array  # [slots] float32: the prefix's score
    base: jax.Array  # [slots] float32: its parent's score
    parent: jax.Array  # [slots] int32: its parent node
    depth: jax.Array  # [slots] int32: its depth (>= 1)
    rank: jax.Array  # [slots] int32: its token's rank at that depth
    ranks: jax.Array  # [slots, depth_limit] int32: the ranks along its path, -1 past its depth

    def put(self, slot, **fields) -> _Candidates:
        """The candidates with slot `slot` set to `fields` (every field named)."""
        return _Candidates(**{name: getattr(self, name).at[slot].set(v) for name, v in fields.items()})


def _best(c: _Candidates) -> tuple[jax.Array, jax.Array]:
    """(slot, any candidate left): the highest score, ties to the lexicographically smallest ranks (a
    shorter path first when one is the other's prefix: the -1 padding sorts first). The tie-break compares
    every pair of slots at their first differing depth at once, rather than one reduction per depth."""
    top = jnp.max(jnp.where(c.valid, c.score, -jnp.inf))
    tied = c.valid & (c.score == top)
    slot = jnp.arange(tied.shape[0])
    differ = c.ranks[:, None, :] != c.ranks[None, :, :]  # [slots, slots, depth_limit]
    first = jnp.argmax(differ, axis=-1)  # [slots, slots]: the first depth where slots i and j differ
    mine, theirs = c.ranks[slot[:, None], first], c.ranks[slot[None, :], first]
    before = jnp.any(differ, axis=-1) & (mine < theirs)  # [slots, slots]: slot i sorts before slot j
    wins = tied & jnp.all(before | ~tied[None, :] | (slot[:, None] == slot[None, :]), axis=1)
    return jnp.argmax(wins).astype(jnp.int32), jnp.any(tied)


def _root_only(root: jax.Array, nodes: int) -> TokenTree:
    """A tree of `nodes` entries holding only the root; the rest padding."""
    index = jnp.arange(nodes, dtype=jnp.int32)
    return TokenTree(
        tokens=jnp.zeros((nodes,), jnp.int32).at[0].set(root),
        parents=jnp.where(index == 0, -1, 0).astype(jnp.int32),
        depth=jnp.where(index == 0, 0, 1).astype(jnp.int32),
        valid=index == 0,
        score=jnp.where(index == 0, 0.0, -jnp.inf).astype(jnp.float32),
    )


def build_tree_host(root_token: int, top_log_probs, top_tokens, budget: int) -> dict[str, np.ndarray]:
    """`build_tree_from_top_k` on the host with Python's heapq, as DDTree's reference `build_ddtree_tree`
    writes it (heap keys (-score, ranks)); the oracle the device version is tested against.

    Args:
      root_token: the root's token.
      top_log_probs: [depth_limit, top_k] float32, descending per row; top_tokens: [depth_limit, top_k] int.
      budget: nodes to place besides the root.

    Returns:
      numpy arrays "tokens", "parents", "depth", "valid", "score" laid out as `TokenTree`'s fields.
    """
    lp = np.asarray(top_log_probs, np.float32)
    ids = np.asarray(top_tokens, np.int64)
    depth_limit, k = lp.shape
    nodes = budget + 1
    out = {
        "tokens": np.zeros(nodes, np.int32),
        "parents": np.zeros(nodes, np.int32),
        "depth": np.ones(nodes, np.int32),
        "valid": np.zeros(nodes, bool),
        "score": np.full(nodes, -np.inf, np.float32),
    }
    out["tokens"][0], out["parents"][0], out["depth"][0], out["valid"][0], out["score"][0] = (
        root_token,
        -1,
        0,
        True,
        0.0,
    )
    # (-score, ranks, parent, depth, rank, score, parent's score)
    heap = [(-lp[0, 0], (0,), 0, 1, 0, lp[0, 0], np.float32(0.0))] if depth_limit and budget else []
    count = 0
    while heap and count < budget:
        _, ranks, parent, depth, rank, score, base = heapq.heappop(heap)
        count += 1
        out["tokens"][count], out["parents"][count], out["depth"][count] = ids[depth - 1, rank], parent, depth
        out["valid"][count], out["score"][count] = True, score
        if rank + 1 < k:
            sibling = np.float32(base + lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling, base))
        if depth < depth_limit:
            child = np.float32(score + lp[depth, 0])
            heapq.heappush(heap, (-child, ranks + (0,), count, depth + 1, 0, child, score))
    return out
