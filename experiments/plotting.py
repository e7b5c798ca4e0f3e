"""What the experiments share: the command line of one experiment and a matplotlib figure saved as PNG."""

from __future__ import annotations

import argparse
import pathlib

IMG_DIR = pathlib.Path(__file__).parents[1] / "docs" / "img"


def measured(records: list[dict], implementation: str) -> list[dict]:
    """The records of `implementation` that hold figures (skipped ones left out)."""
    return [r for r in records if r["implementation"] == implementation and r["figures"]]


def title(records: list[dict], what: str) -> str:
    """`what`, then the device and JAX version the records were measured with."""
    if not records:
        return what
    return f"{what}\n{records[0]['device']}, JAX {records[0]['jax_version']}"


def pyplot():
    """matplotlib.pyplot with the file-only backend (the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, img_dir: str | pathlib.Path, name: str) -> pathlib.Path:
    """Writes `fig` to img_dir/<name>.png and closes it."""
    path = pathlib.Path(img_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def main(configs: dict, run, description: str) -> None:
    """`python -m experiments.<name> [config] [--img-dir D] [--out F]`: runs one of `configs`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("config", nargs="?", default="full", choices=sorted(configs))
    p.add_argument("--img-dir", default=str(IMG_DIR), help="where the PNG goes")
    p.add_argument("--out", default=None, help="also append the benchmark's JSON lines here")
    a = p.parse_args()
    run(configs[a.config], img_dir=a.img_dir, out=a.out)
