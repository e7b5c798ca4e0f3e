"""Measured defaults as data: one JSON table per device kind, read at trace time.

A kernel or scheduler asks `lookup(op, shape_class)` for the knobs measured best on the running device and
fills the rest from its own heuristic (the tokamax pattern: a small config, heuristics, and a table of
measured choices). Tables live beside this file as `<device slug>.json`:

    {"gated_delta_rule.triton": {"default": {"state_stages": 3}, "packed": {...}}, "offload": {...}}

An op's `"default"` entry applies to every shape class; a named class overrides it field by field. An unknown
device, op or class gives `{}`, so the heuristic alone decides. How each figure was measured is in
`docs/performance.md`, not here.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
from typing import Any

import jax

TABLES = pathlib.Path(__file__).parent


def device_slug(device_kind: str) -> str:
    """File name stem of a device kind: "NVIDIA A100-SXM4-80GB" -> "nvidia_a100_sxm4_80gb"."""
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")


def current_device_kind() -> str:
    """`device_kind` of the first JAX device ("cpu" off GPU)."""
    return jax.devices()[0].device_kind


@functools.cache
def table(device_kind: str) -> dict[str, dict[str, dict[str, Any]]]:
    """The whole tuning table of `device_kind`; `{}` where none is stored.

    Raises:
      ValueError: the stored file is not a JSON object of objects (names the file).
    """
    path = TABLES / f"{device_slug(device_kind)}.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"tuning table {path} must map op names to objects of shape classes")
    return data


def lookup(op: str, shape_class: str = "default", *, device_kind: str | None = None) -> dict[str, Any]:
    """Measured knobs of `op` for `shape_class` on `device_kind` (default: the running device).

    Returns the op's "default" entry updated by the `shape_class` entry; `{}` for an unknown device or op.
    """
    entries = table(device_kind or current_device_kind()).get(op, {})
    return {**entries.get("default", {}), **entries.get(shape_class, {})}
