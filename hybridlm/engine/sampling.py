"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def sample(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    temperature: float | jax.Array = 0.0,
    top_k: int = 0,
    top_p: float | jax.Array = 1.0,
) -> jax.Array:
    """Picks one token per row.

    Args:
      logits: [batch, vocab] float32.
      key: PRNG key (unused, and may be None, for greedy decoding: a Python temperature of 0).
      temperature: 0 means greedy (argmax); otherwise logits are divided by it.
      top_k: keep only the k most likely tokens (0: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all).

    Returns:
      [batch] int32 token ids.

    Raises:
      ValueError: key is None where the tokens are sampled (a temperature other than a Python 0), or a setting
        out of range (`check_sampling`).

    A Python temperature of 0 runs the argmax alone, and a Python top_p of 1 skips the nucleus' sort of the
    vocabulary (a decode step's cost: 248 320 logits); array arguments take the general program.
    """
    check_sampling(temperature, top_k, top_p)
    if is_greedy(temperature):
        return _greedy(logits)
    if key is None:
        raise ValueError(
            f"sampling at temperature={temperature!r} needs a PRNG key (key=None only for greedy "
            "decoding, a Python temperature of 0)"
        )
    return _sample(logits, key, temperature, top_p, top_k=top_k, nucleus=nucleus_applies(top_p))


def check_sampling(temperature, top_k: int, top_p) -> None:
    """Refuses sampling settings that would silently mean something else: a negative temperature (the program
    would fall back to greedy), a negative top_k, a top_p outside (0, 1] (at 0 or below the nucleus would keep
    every token). Array values (traced or on the device) are not read back.

    Raises:
      ValueError: naming the setting and its valid range.
    """
    if isinstance(temperature, (int, float)) and not temperature >= 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0: greedy)")
    if not (isinstance(top_k, numbers.Integral) and top_k >= 0):
        raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0: no limit)")
    if isinstance(top_p, (int, float)) and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must lie in (0, 1] (1: no limit)")


def is_greedy(temperature) -> bool:
    """Whether `sample` at this temperature is greedy decoding: a Python 0 (an array temperature always takes
    the general program, which needs a key)."""
    return isinstance(temperature, (int, float)) and temperature == 0


def nucleus_applies(top_p) -> bool:
    """Whether `sample` runs the nucleus filter at this top_p: always but for a Python top_p >= 1, where
    skipping it saves a sort of the vocabulary (an array top_p always takes the filter)."""
    return not (isinstance(top_p, (int, float)) and top_p >= 1)


def filter_logits(
    logits: jax.Array, temperature: float | jax.Array, top_p: float | jax.Array, *, top_k: int, nucleus: bool
) -> jax.Array:
    """The logits `sample` draws from at temperature > 0: divided by the temperature, -inf outside the top-k
    and the nucleus (ties at either cut are kept). Jittable; temperature and top_p may be traced.

    Args:
      logits: [..., vocab] float32.
      temperature: scalar > 0 (clamped to 1e-6 from below).
      top_p: scalar in (0, 1]; read only where nucleus is True.
      top_k: keep the top_k largest logits (0: all); static.
      nucleus: apply the top_p filter (`nucleus_applies`); static.

    Returns:
      [..., vocab] float32; softmax of it is the sampling distribution.
    """
    scaled = logits / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    if top_k:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    if nucleus:
        sorted_logits = jnp.sort(scaled, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # smallest logit still inside the nucleus: tokens before it have cumulative mass < top_p
        cutoff_index = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True) - 1
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    return scaled


@jax.jit
def _greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("top_k", "nucleus"))
def _sample(logits, key, temperature, top_p, *, top_k: int, nucleus: bool):
    greedy = _greedy(logits)
    scaled = filter_logits(logits, temperature, top_p, top_k=top_k, nucleus=nucleus)
    sampled = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.asarray(temperature) > 0, sampled, greedy)


@dataclasses.dataclass(frozen=True)
class BlockSampler:
    """The static part of a decode block's sampling (`phases.decode_block`): block length, greedy or not,
    top_k and whether a nucleus is cut. Temperature, top_p and the stop ids travel as arrays (`block_carry`),
    so requests that differ only in them share one compiled program.

    Args:
      block: decode steps per program (>= 1).
      greedy: argmax (temperature a Python 0); otherwise `sample`'s general program.
      top_k: keep the k most likely tokens (0: all).
      nucleus: cut a top_p nucleus (False when top_p is a Python 1).
    """

    block: int
    greedy: bool = True
    top_k: int = 0
    nucleus: bool = False

    @classmethod
    def of(cls, block: int, temperature, top_k: int, top_p) -> BlockSampler:
        """The sampler for `sample`'s settings (checked by `check_sampling`)."""
        check_sampling(temperature, top_k, top_p)
        nucleus = not (isinstance(top_p, (int, float)) and top_p >= 1)
        return cls(block, is_greedy(temperature), top_k if not is_greedy(temperature) else 0, nucleus)

    def pick(self, logits, key, temperature, top_p):
        """One token per row of logits [batch, vocab] -> ([batch] int32, the key after it), as `generate`'s
        host loop would sample (one split per sampled token)."""
        if self.greedy:
            return _greedy(logits), key
        key, sub = jax.random.split(key)
        return _sample(logits, sub, temperature, top_p, top_k=self.top_k, nucleus=self.nucleus), key

    def loop(self, step, token, states, position, carry, steps):
        """Runs `step(tokens, states, position) -> (logits, states)` up to `steps` times on the device, each
        sampled token fed to the next step, stopping early once every row has produced a stop id.

        Args:
          carry: (key, finished [batch] bool, stop_ids [n] int32, temperature, top_p) from `block_carry`.

        Returns:
          (tokens [batch, block] int32 valid up to count, count, last token, states, position, carry).
        """
        key, finished, stop_ids, temperature, top_p = carry
        out = jnp.zeros((token.shape[0], self.block), jnp.int32)

        def cond(c):
            return (c[0] < steps) & ~jnp.all(c[5])

        def body(c):
            i, token, states, position, key, finished, out = c
            logits, states = step(token, states, position)
            token, key = self.pick(logits, key, temperature, top_p)
            finished = finished | jnp.any(token[:, None] == stop_ids[None, :], axis=1)
            out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], i, axis=1)
            return i + 1, token, states, position + 1, key, finished, out

        init = (jnp.int32(0), token, states, jnp.asarray(position, jnp.int32), key, finished, out)
        count, token, states, position, key, finished, out = jax.lax.while_loop(cond, body, init)
        return out, count, token, states, position, (key, finished, stop_ids, temperature, top_p)


def host_block(sampler: BlockSampler, step, token, states, position: int, carry, steps: int) -> tuple:
    """`BlockSampler.loop` as a host loop of `step` calls (runners whose step is not one traceable function,
    e.g. the offload runner's): the same outputs, every step run (stop ids only mark rows finished)."""
    key, finished, stop_ids, temperature, top_p = carry
    watch = bool((np.asarray(stop_ids) >= 0).any())  # reading `finished` waits for the step: only if needed
    tokens = []
    for i in range(steps):
        if watch and bool(finished.all()):
            break
        logits, states = step(token, states, position + i)
        token, key = sampler.pick(logits, key, temperature, top_p)
        finished = finished | jnp.any(token[:, None] == stop_ids[None, :], axis=1)
        tokens.append(token)
    out = jnp.zeros((token.shape[0], sampler.block), jnp.int32)
    if tokens:
        out = out.at[:, : len(tokens)].set(jnp.stack(tokens, axis=1))
    carry = (key, finished, stop_ids, temperature, top_p)
    return out, np.int32(len(tokens)), token, states, position + len(tokens), carry


def block_carry(key, finished, stop_ids, temperature, top_p) -> tuple:
    """The traced sampling state of a decode block: (key, finished [batch] bool, stop ids [n] int32 (at least
    one entry: -1 stands for none), temperature float32, top_p float32)."""
    stop = np.asarray(stop_ids, np.int32).reshape(-1)
    stop = stop if stop.size else np.full((1,), -1, np.int32)
    key = jax.random.key(0) if key is None else key
    return (
        key,
        jnp.asarray(finished, bool),
        jnp.asarray(stop),
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_p, jnp.float32),
    )
