"""The bundled image prompt set (`eval.prompt_sets: [images]`): pictures the project draws itself, so a head's
acceptance on image prompts is measured without a download.

    eagle3 eval --config configs/kimi-k2.5.yaml eval.prompt_sets='[images,mt-bench]'

Four kinds, each a card category, three pictures each, 448x448 px (K2.5 and Qwen2.5-VL make 256 image tokens of
one): `chart` (a bar chart with its labels and values), `shapes` (coloured shapes on a plain ground), `text` (a
paragraph of rendered prose), `code` (a screenshot of a short Python function). Each is asked one question whose
answer reads the picture: describe it, transcribe it, explain it. Every picture is drawn from fixed data with
Pillow and written once under `$EAGLE3_HOME/image-prompts/` (PNG bytes are the same on every machine with the same
Pillow); the prompts name them by path, as a user's conversation would.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.bundled import eagle3_home
from eagle3.data.images import IMAGE_MARK
from eagle3.data.types import Turn
from eagle3.fsutil import atomic_dir

SIDE = 448
VERSION = "v1"  # bump when a picture changes: a folder holds one version's pictures

_CHARTS = [
    ("Quarterly revenue (M$)", [("Q1", 12), ("Q2", 18), ("Q3", 9), ("Q4", 24)]),
    ("Languages used by the team", [("Python", 41), ("Rust", 17), ("Go", 12), ("C++", 30)]),
    ("Rainfall per month (mm)", [("Jan", 78), ("Feb", 52), ("Mar", 61), ("Apr", 44), ("May", 30)]),
]
_SHAPES = [
    [("circle", "red", (60, 60, 180, 180)), ("square", "blue", (250, 240, 400, 390))],
    [("triangle", "green", (224, 50, 100, 300, 348, 300)), ("circle", "orange", (300, 320, 400, 420))],
    [("square", "purple", (40, 260, 160, 380)), ("circle", "teal", (170, 80, 290, 200)),
     ("triangle", "gold", (330, 250, 270, 380, 400, 380))],
]
_TEXTS = [
    "The museum opens at nine on weekdays and at ten on weekends. Tickets bought online are valid for one year "
    "and include the special exhibition on the second floor.",
    "To reset the router, hold the small button on its back for ten seconds until the light blinks amber, then "
    "wait two minutes before connecting again.",
    "Meeting notes: the launch moves to March; Ana owns the migration plan; the budget review is on Friday; "
    "nobody has objected to the new naming scheme.",
]
_CODE = [
    "def mean(xs):\n    if not xs:\n        return 0.0\n    return sum(xs) / len(xs)\n",
    "def is_palindrome(s):\n    s = ''.join(c.lower() for c in s\n                if c.isalnum())\n    return s == s[::-1]\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
]
_QUESTIONS = {
    "chart": "Describe this chart: what does it show, and which bar is the largest?",
    "shapes": "List every shape in this picture with its colour and where it is.",
    "text": "Transcribe the text in this image exactly, then summarise it in one sentence.",
    "code": "What does this Python function do? Explain it line by line.",
}


def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _chart(i: int) -> Any:
    from PIL import Image, ImageDraw

    title, bars = _CHARTS[i]
    img = Image.new("RGB", (SIDE, SIDE), "white")
    d = ImageDraw.Draw(img)
    d.text((20, 15), title, fill="black", font=_font(20))
    top = max(v for _, v in bars)
    w = (SIDE - 60) // len(bars)
    for k, (label, v) in enumerate(bars):
        x0, h = 40 + k * w, int(300 * v / top)
        d.rectangle((x0, 390 - h, x0 + w - 20, 390), fill=("steelblue", "indianred", "seagreen", "darkorange",
                                                          "slateblue")[k])
        d.text((x0, 395), label, fill="black", font=_font(16))
        d.text((x0, 370 - h), str(v), fill="black", font=_font(16))
    d.line((30, 390, SIDE - 10, 390), fill="black", width=2)
    return img


def _shapes(i: int) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE), "whitesmoke")
    d = ImageDraw.Draw(img)
    for kind, colour, xy in _SHAPES[i]:
        if kind == "circle":
            d.ellipse(xy, fill=colour)
        elif kind == "square":
            d.rectangle(xy, fill=colour)
        else:
            d.polygon(list(zip(xy[::2], xy[1::2], strict=True)), fill=colour)
    return img


def _lines(lines: list[str], size: int, ground: str, ink: str) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE), ground)
    d = ImageDraw.Draw(img)
    for k, line in enumerate(lines):
        d.text((16, 20 + k * int(size * 1.5)), line, fill=ink, font=_font(size))
    return img


DRAW: dict[str, Callable[[int], Any]] = {
    "chart": _chart,
    "shapes": _shapes,
    "text": lambda i: _lines(textwrap.wrap(_TEXTS[i], 34), 20, "white", "black"),
    "code": lambda i: _lines(_CODE[i].splitlines(), 18, "#1e1e1e", "#d4d4d4"),
}
COUNT = 3
"""Pictures per kind."""


def pictures(folder: Path | None = None) -> Path:
    """The folder of every picture (`<kind>-<i>.png`), drawn the first time it is asked for: all of them into a
    hidden sibling swapped in whole (eagle3.fsutil.atomic_dir), so a folder that exists is complete."""
    folder = folder or eagle3_home() / "image-prompts" / VERSION
    if not folder.is_dir():
        with atomic_dir(folder) as tmp:
            for kind, draw in DRAW.items():
                for i in range(COUNT):
                    draw(i).save(tmp / f"{kind}-{i}.png", format="PNG")
    return folder


def image_prompt_rows(folder: Path | None = None) -> list[tuple[str, str, Turn]]:
    """(id, category, the user turn) of every prompt: the picture first, then the question."""
    folder = pictures(folder)
    return [(f"{kind}-{i}", kind, Turn("user", f"{IMAGE_MARK}\n{_QUESTIONS[kind]}",
                                       images=(str(folder / f"{kind}-{i}.png"),)))
            for kind in DRAW for i in range(COUNT)]
