"""Synthetic pictures for the demo model's vision tower: one to three shapes of one kind and one colour on a light
background, each with its caption ("two red circles") and the answers to a few questions about it.

Everything is drawn from a seed (numpy's PCG64 and Pillow's ImageDraw), so a held-out set is a different seed and a test's
fixed images are a fixed seed. Pillow is the optional `vision` extra, imported where a picture is drawn.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
KINDS = ("circle", "square", "triangle")
COUNTS = ("one", "two", "three")
# question -> which property of the picture answers it
QUESTIONS = {
    "What colour is the shape?": "colour",
    "What shape is it?": "kind",
    "How many shapes are there?": "count",
    "Describe the image.": "caption",
}
SIZES = (112, 128, 160, 224, 320)  # square sides the pictures are drawn at (the processor scales each to 8 x 8 patches)


@dataclass(frozen=True)
class Picture:
    """One drawn picture (PNG bytes) and what is in it."""

    png: bytes
    colour: str
    kind: str
    count: int

    def answer(self, question: str) -> str:
        """The demo's answer to one of QUESTIONS: a colour, a shape, a count word, or "two red circles"."""
        what = QUESTIONS.get(question)
        if what is None:
            raise ValueError(f"question {question!r} is not one of the demo's {list(QUESTIONS)}")
        if what == "colour":
            return self.colour
        if what == "kind":
            return self.kind
        if what == "count":
            return COUNTS[self.count - 1]
        return self.caption

    @property
    def caption(self) -> str:
        """ "two red circles": the count, the colour and the kind."""
        return f"{COUNTS[self.count - 1]} {self.colour} {self.kind}{'s' if self.count > 1 else ''}"


def _free_spot(rng: np.random.Generator, side: int, radius: int, taken: list[tuple[int, int, int]]) -> tuple[int, int]:
    """A centre whose disc of `radius` stays inside the picture and off the discs already `taken` (rejection sampling)."""
    for _ in range(200):
        x, y = (int(v) for v in rng.integers(radius + 2, side - radius - 2, 2))
        if all((x - a) ** 2 + (y - b) ** 2 > (radius + r + 4) ** 2 for a, b, r in taken):
            return x, y
    raise RuntimeError(f"no free spot for a shape of radius {radius} in a {side}-pixel picture")


def draw(rng: np.random.Generator) -> Picture:
    """One random picture: a colour, a kind, 1-3 shapes of radius 1/12-1/8 of the side, a slightly varied background."""
    from PIL import Image, ImageDraw

    side = int(rng.choice(SIZES))
    colour, kind, count = str(rng.choice(list(COLOURS))), str(rng.choice(KINDS)), int(rng.integers(1, 4))
    background = tuple(int(v) for v in rng.integers(215, 256, 3))
    image = Image.new("RGB", (side, side), background)
    pen = ImageDraw.Draw(image)
    rgb = tuple(int(np.clip(c + d, 0, 255)) for c, d in zip(COLOURS[colour], rng.integers(-20, 21, 3), strict=True))
    taken: list[tuple[int, int, int]] = []
    for _ in range(count):
        r = int(rng.integers(side // 12, side // 8 + 1))
        x, y = _free_spot(rng, side, r, taken)
        taken.append((x, y, r))
        if kind == "circle":
            pen.ellipse((x - r, y - r, x + r, y + r), fill=rgb)
        elif kind == "square":
            s = int(r * 0.85)
            pen.rectangle((x - s, y - s, x + s, y + s), fill=rgb)
        else:
            pen.polygon([(x, y - r), (x - r, y + int(r * 0.8)), (x + r, y + int(r * 0.8))], fill=rgb)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return Picture(buf.getvalue(), colour, kind, count)


def pictures(seed: int, n: int) -> list[Picture]:
    """`n` pictures from `seed` (the same seed gives the same pictures)."""
    rng = np.random.default_rng(seed)
    return [draw(rng) for _ in range(n)]
