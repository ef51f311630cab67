"""The loss curve as a PNG: with matplotlib when it is installed, else a small built-in plotter.

matplotlib is not a dependency of shardwise. Without it, ``write_loss_plot`` draws the curve
itself (axes, grid, the loss polyline, min/max and step labels in a 5x7 pixel font) and encodes
the PNG with zlib, so ``--plot`` works on any machine.
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["write_loss_plot", "render_loss_png", "encode_png"]

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 24, 40
WHITE, BLACK, GREY, BLUE = (255, 255, 255), (0, 0, 0), (220, 220, 220), (31, 119, 180)

# 5x7 glyphs, one string of 7 rows of 5 bits per character (enough for numbers and axis names).
_FONT = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    ".": "00000 00000 00000 00000 00000 01100 01100", "-": "00000 00000 00000 11111 00000 00000 00000",
    " ": "00000 00000 00000 00000 00000 00000 00000", "e": "00000 00000 01110 10001 11111 10000 01110",
    "l": "01100 00100 00100 00100 00100 00100 01110", "o": "00000 00000 01110 10001 10001 10001 01110",
    "s": "00000 00000 01111 10000 01110 00001 11110", "t": "01000 01000 11100 01000 01000 01001 00110",
    "p": "00000 00000 11110 10001 11110 10000 10000",
}


def write_loss_plot(path: str, losses: list[float], title: str = "", first_step: int = 1) -> str:
    """Write the loss curve to ``path``, ``losses[0]`` at step ``first_step`` (a resumed run's
    first step); return a line saying how it was drawn."""
    plt = _pyplot()
    if plt is None:  # outside the ImportError handler: a failed write is not chained under it
        with open(path, "wb") as f:
            f.write(render_loss_png(losses, first_step))
        return f"loss plot: {path} (built-in plotter; install matplotlib for a labelled chart)"
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(range(first_step, first_step + len(losses)), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"loss plot: {path}"


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


class _Canvas:
    """An RGB pixel grid with the few drawing operations a line chart needs."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(WHITE) * width) for _ in range(height)]

    def dot(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x:3 * x + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        """Bresenham's line, two pixels thick vertically for visibility."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, color)
            self.dot(x0, y0 + 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, text: str, color: tuple[int, int, int] = BLACK) -> None:
        for i, ch in enumerate(text):
            rows = _FONT.get(ch, _FONT[" "]).split()
            for r, bits in enumerate(rows):
                for c, bit in enumerate(bits):
                    if bit == "1":
                        self.dot(x + 6 * i + c, y + r, color)


def render_loss_png(losses: list[float], first_step: int = 1) -> bytes:
    """PNG bytes of the loss curve (step on x from ``first_step``, loss on y)."""
    canvas = _Canvas(WIDTH, HEIGHT)
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP
    lo, hi = (min(losses), max(losses)) if losses else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    n = max(len(losses), 2)
    for k in range(5):  # horizontal grid lines with their loss values
        y = y0 + (y1 - y0) * k // 4
        canvas.line(x0, y, x1, y, GREY)
        canvas.text(4, y - 3, f"{lo + (hi - lo) * k / 4:.3f}"[:9])
    canvas.line(x0, y0, x1, y0, BLACK)
    canvas.line(x0, y0, x0, y1, BLACK)
    last = str(first_step + max(len(losses), 1) - 1)
    canvas.text(x0, y0 + 8, str(first_step))
    canvas.text(x1 - 6 * len(last), y0 + 8, last)
    canvas.text((x0 + x1) // 2 - 12, y0 + 22, "step")
    canvas.text(4, 8, "loss")

    def point(i: int, v: float) -> tuple[int, int]:
        return x0 + round((x1 - x0) * i / (n - 1)), y0 + round((y1 - y0) * (v - lo) / (hi - lo))

    for i in range(1, len(losses)):
        canvas.line(*point(i - 1, losses[i - 1]), *point(i, losses[i]), BLUE)
    if len(losses) == 1:
        canvas.dot(*point(0, losses[0]), BLUE)
    return encode_png(canvas.width, canvas.height, canvas.rows)


def encode_png(width: int, height: int, rows: list[bytes]) -> bytes:
    """8-bit RGB PNG of ``rows`` (each ``3 * width`` bytes), unfiltered, zlib-compressed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = b"".join(b"\x00" + bytes(row) for row in rows)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
