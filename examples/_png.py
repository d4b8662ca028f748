"""A tiny PNG line-plot renderer (zlib + struct only), for the example scripts' result figures.

`Canvas` is an RGB bitmap with lines, rectangles and text in a built-in 5x7 font (digits,
capitals, a little punctuation; lowercase prints as capitals); `Canvas.png()` encodes it as an
8-bit truecolor PNG. `plot()` draws line and point series on labelled axes with a legend.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

Color = tuple[int, int, int]
WHITE, BLACK, GREY, LIGHT = (255, 255, 255), (0, 0, 0), (110, 110, 110), (225, 225, 225)

# Each glyph: 7 rows of 5 pixels, one hex byte per row, the high bit (0x10) leftmost.
_GLYPHS = {
    "0": "0E 11 13 15 19 11 0E", "1": "04 0C 04 04 04 04 0E", "2": "0E 11 01 02 04 08 1F",
    "3": "1F 02 04 02 01 11 0E", "4": "02 06 0A 12 1F 02 02", "5": "1F 10 1E 01 01 11 0E",
    "6": "06 08 10 1E 11 11 0E", "7": "1F 01 02 04 08 08 08", "8": "0E 11 11 0E 11 11 0E",
    "9": "0E 11 11 0F 01 02 0C", "A": "0E 11 11 11 1F 11 11", "B": "1E 11 11 1E 11 11 1E",
    "C": "0E 11 10 10 10 11 0E", "D": "1C 12 11 11 11 12 1C", "E": "1F 10 10 1E 10 10 1F",
    "F": "1F 10 10 1E 10 10 10", "G": "0E 11 10 17 11 11 0F", "H": "11 11 11 1F 11 11 11",
    "I": "0E 04 04 04 04 04 0E", "J": "07 02 02 02 02 12 0C", "K": "11 12 14 18 14 12 11",
    "L": "10 10 10 10 10 10 1F", "M": "11 1B 15 15 11 11 11", "N": "11 11 19 15 13 11 11",
    "O": "0E 11 11 11 11 11 0E", "P": "1E 11 11 1E 10 10 10", "Q": "0E 11 11 11 15 12 0D",
    "R": "1E 11 11 1E 14 12 11", "S": "0F 10 10 0E 01 01 1E", "T": "1F 04 04 04 04 04 04",
    "U": "11 11 11 11 11 11 0E", "V": "11 11 11 11 11 0A 04", "W": "11 11 11 15 15 15 0A",
    "X": "11 11 0A 04 0A 11 11", "Y": "11 11 11 0A 04 04 04", "Z": "1F 01 02 04 08 10 1F",
    " ": "00 00 00 00 00 00 00", ".": "00 00 00 00 00 0C 0C", ",": "00 00 00 00 0C 04 08",
    "-": "00 00 00 1F 00 00 00", "+": "00 04 04 1F 04 04 00", "=": "00 00 1F 00 1F 00 00",
    "(": "02 04 08 08 08 04 02", ")": "08 04 02 02 02 04 08", ":": "00 0C 0C 00 0C 0C 00",
    "/": "00 01 02 04 08 10 00", "%": "18 19 02 04 08 13 03", "_": "00 00 00 00 00 00 1F",
    "?": "0E 11 01 02 04 00 04", "x": "00 11 0A 04 0A 11 00",
}  # fmt: skip
FONT = {ch: [int(row, 16) for row in rows.split()] for ch, rows in _GLYPHS.items()}


class Canvas:
    """A width x height RGB bitmap, origin top left."""

    def __init__(self, width: int, height: int, background: Color = WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.width + x)
        return tuple(self.pixels[i : i + 3])  # type: ignore[return-value]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), both included."""
        for y in range(min(y0, y1), max(y0, y1) + 1):
            for x in range(min(x0, x1), max(x0, x1) + 1):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham's line, thickened to a `width`-pixel square pen."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, lo = dx + dy, -(width // 2)
        while True:
            self.rect(x0 + lo, y0 + lo, x0 + lo + width - 1, y0 + lo + width - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color: Color = BLACK, scale: int = 2) -> int:
        """Draw `s` with its top left at (x, y); return the x just past its end."""
        for ch in s:
            rows = FONT.get(ch, FONT.get(ch.upper(), FONT["?"]))
            for r, bits in enumerate(rows):
                for c in range(5):
                    if bits & (0x10 >> c):
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale - 1,
                                  y + (r + 1) * scale - 1, color)  # fmt: skip
            x += 6 * scale
        return x

    def png(self) -> bytes:
        """The bitmap as a PNG file: 8-bit RGB, no interlace, filter 0 on every row."""

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        stride = 3 * self.width
        raw = b"".join(
            b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height)
        )
        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def text_width(s: str, scale: int = 2) -> int:
    return 6 * scale * len(s) - scale


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    span = (hi - lo) or abs(hi) or 1.0
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    n = math.ceil((hi - first) / step - 1e-9)
    return [round(first + i * step, 12) for i in range(n + 1)]


def _fmt(v: float, ticks: Sequence[float]) -> str:
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    digits = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{v:.{digits}f}"


@dataclass(frozen=True)
class Series:
    """One curve: `points=True` draws squares at (xs, ys) instead of a connected line."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: Color
    points: bool = False


def plot(
    series: Sequence[Series],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    width: int = 800,
    height: int = 500,
) -> Canvas:
    """Series on linear axes with tick labels, grid, axis labels, a title and a legend."""
    cv = Canvas(width, height)
    left, right, top, bottom = 80, width - 20, 50, height - 60
    xs = [x for s in series for x in s.xs]
    ys = [y for s in series for y in s.ys if math.isfinite(y)]
    xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys), target=10)
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def px(x: float) -> int:
        return round(left + (x - x0) / ((x1 - x0) or 1) * (right - left))

    def py(y: float) -> int:
        return round(bottom - (y - y0) / ((y1 - y0) or 1) * (bottom - top))

    for t in xt:
        cv.line(px(t), top, px(t), bottom, LIGHT)
        label = _fmt(t, xt)
        cv.text(px(t) - text_width(label) // 2, bottom + 8, label)
    for t in yt:
        cv.line(left, py(t), right, py(t), LIGHT)
        label = _fmt(t, yt)
        cv.text(left - 8 - text_width(label), py(t) - 7, label)
    cv.line(left, top, left, bottom, BLACK)
    cv.line(left, bottom, right, bottom, BLACK)
    cv.text((left + right - text_width(xlabel)) // 2, height - 24, xlabel)
    cv.text(8, 18, ylabel)
    cv.text((left + right - text_width(title)) // 2, 14, title)

    for s in series:
        pts = [(px(x), py(y)) for x, y in zip(s.xs, s.ys, strict=True) if math.isfinite(y)]
        if s.points:
            for x, y in pts:
                cv.rect(x - 3, y - 3, x + 3, y + 3, s.color)
        else:
            for (a, b), (c, d) in pairwise(pts):
                cv.line(a, b, c, d, s.color, width=2)

    lx = right - 10 - max(text_width(s.label) for s in series) - 34
    ly = top + 10
    cv.rect(lx - 8, ly - 8, right - 4, ly + 22 * len(series) - 6, WHITE)
    for i, s in enumerate(series):
        y = ly + 22 * i + 7
        if s.points:
            cv.rect(lx + 10, y - 3, lx + 16, y + 3, s.color)
        else:
            cv.line(lx, y, lx + 26, y, s.color, width=2)
        cv.text(lx + 34, y - 7, s.label)
    return cv
