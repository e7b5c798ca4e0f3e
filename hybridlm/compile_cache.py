"""JAX's persistent compilation cache, on by default: a second process with the same model, chunk size and
options loads its programs from disk instead of compiling them again.

The directory is `$HYBRIDLM_COMPILE_CACHE` if set ("off" disables), else `$XDG_CACHE_HOME/hybridlm/jax`
(`~/.cache/hybridlm/jax`). A cache directory the user configured in JAX themselves is left alone.
Counters of compilations and cache hits in this process come from `jax.monitoring` events.
"""

from __future__ import annotations

import os
import threading

import jax

__all__ = ["CompileCounters", "counters", "default_dir", "enable"]

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def default_dir() -> str | None:
    """The cache directory hybridlm uses, or None when `HYBRIDLM_COMPILE_CACHE=off`."""
    env = os.environ.get("HYBRIDLM_COMPILE_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hybridlm", "jax")


def enable(cache_dir: str | None = None) -> str | None:
    """Turns the persistent compilation cache on (every program, however fast it compiled), unless JAX
    already has a cache directory.

    Args:
      cache_dir: the directory; None: `default_dir()`; "off": leave the cache off.

    Returns:
      The directory in use, or None when the cache is off.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    cache_dir = default_dir() if cache_dir is None else cache_dir
    if not cache_dir or cache_dir == "off":
        return None
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir


class CompileCounters:
    """Seconds spent tracing, lowering and compiling, and persistent-cache hits and misses, since creation
    (process-wide `jax.monitoring` listeners, registered once)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.compile_s = 0.0
        self.hits = 0
        self.misses = 0

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event in _COMPILE_EVENTS:
            with self.lock:
                self.compile_s += seconds

    def _event(self, event: str, **_) -> None:
        with self.lock:
            if event == "/jax/compilation_cache/cache_hits":
                self.hits += 1
            elif event == "/jax/compilation_cache/cache_misses":
                self.misses += 1

    def snapshot(self) -> dict:
        with self.lock:
            return {"compile_s": self.compile_s, "cache_hits": self.hits, "cache_misses": self.misses}


_counters: CompileCounters | None = None


def counters() -> CompileCounters:
    """The process's counters (listeners registered on first use)."""
    global _counters
    if _counters is None:
        _counters = CompileCounters()
        jax.monitoring.register_event_duration_secs_listener(_counters._duration)
        jax.monitoring.register_event_listener(_counters._event)
    return _counters
