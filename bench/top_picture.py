"""A picture of `kiln top` for the README: one frame of the kiln Redis at KILN_REDIS_URL, saved
as SVG (rich's own export of the live view's tables) and as PNG (the same frame's text drawn in a
monospace font with matplotlib, for viewers without SVG). Run it while workers are working:

    python bench/top_picture.py [--out bench/top]      # writes bench/top.svg and bench/top.png
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from api_client.connection import connect
from worker.ops.top import render, snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/top"), help="path without suffix")
    args = parser.parse_args()
    connection = connect(os.environ.get("KILN_REDIS_URL", "redis://localhost:6379/0"))
    frame = render(snapshot(connection))
    console = Console(record=True, width=200, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(frame)
    text = console.export_text(clear=False)
    console.save_svg(str(args.out.with_suffix(".svg")), title="kiln top")
    draw_png(text, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.svg')} and {args.out.with_suffix('.png')}")


def draw_png(text: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [line.rstrip() for line in text.rstrip().splitlines()]
    figure = plt.figure(dpi=130)
    figure.patch.set_facecolor("#101418")
    drawn = figure.text(
        0, 0, "\n".join(lines), family="monospace", size=8.5, color="#d8dee9", va="bottom"
    )
    figure.canvas.draw()  # measure the text, then fit the page around it with a small margin
    box, margin = drawn.get_window_extent(), 12
    figure.set_size_inches((box.width + 2 * margin) / 130, (box.height + 2 * margin) / 130)
    drawn.set_position((margin / (box.width + 2 * margin), margin / (box.height + 2 * margin)))
    figure.savefig(path, facecolor=figure.get_facecolor())
    plt.close(figure)


if __name__ == "__main__":
    main()
