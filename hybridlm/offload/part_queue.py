"""The queue of whole host parts to copy inside the coming programs of a whole-layer prefill."""

from __future__ import annotations

from collections.abc import Iterable

# Structural, not tuned: at most this many host parts copied inside one program, so that each program compiles
# in MAX_PARTS_PER_PROGRAM + 1 variants (0, 1 or 2 copies inside).
MAX_PARTS_PER_PROGRAM = 2


class PartQueue:
    """(layer, host part) pairs whose pool slots are allocated, to be copied inside the next programs.

    Args:
      num_layers: layers of the model (deadlines wrap around into the next chunk).
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.items: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(list(self.items))

    def push(self, items: Iterable[tuple[int, int]]) -> None:
        """Appends (layer, part) pairs, in the order they should be copied."""
        self.items += list(items)

    def clear(self) -> None:
        self.items.clear()

    def take_layer(self, layer: int) -> list[tuple[int, int]]:
        """Removes and returns the queued parts of `layer` (those no program copied in time)."""
        taken = [q for q in self.items if q[0] == layer]
        if taken:
            self.items = [q for q in self.items if q[0] != layer]
        return taken

    def pop(self, layer_now: int, programs_done: int) -> list[tuple[int, int]]:
        """Host parts to copy inside the next program of layer `layer_now` (its mixer: programs_done=0, its
        experts: 1): at least one if any is queued, and as many as every queued layer's deadline needs, spread
        evenly over the programs left before it (layer j's parts must be copied by the programs of layers
        layer_now..j-1), at most MAX_PARTS_PER_PROGRAM."""
        if not self.items:
            return []
        n, queued = 1, 0

        def ahead(j):
            return (j - layer_now) % self.num_layers

        for j in sorted({q[0] for q in self.items}, key=ahead):
            queued += sum(1 for q in self.items if q[0] == j)
            n = max(n, -(-queued // max(1, 2 * ahead(j) - programs_done)))
        n = min(n, MAX_PARTS_PER_PROGRAM)
        taken, self.items = self.items[:n], self.items[n:]
        return taken
