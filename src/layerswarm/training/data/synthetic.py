"""Generated image-folder datasets for trying the trainer on tasks it was not tuned for.

Five 8-class tasks at 32 x 32, each hard in a different way, written as PNG class folders
(DIR/train/CLASS/*.png, DIR/val/CLASS/*.png) and read back through `imagefolder:DIR` exactly as a
user's own data would be:

- `relations`: a circle and a square; the class is where the circle is relative to the square (left,
  right, above, below) and whether it is the larger of the two. A horizontal mirror swaps left and
  right, so flip augmentation would silently corrupt the labels.
- `textures`: stripes (horizontal, vertical, two diagonals), checks, dots, rings and smooth noise at
  random frequency, phase and colour. The two diagonals are mirror images of each other.
- `faint-textures`: the textures in two close colours under heavy noise, turned a little.
- `counting`: one to eight small blobs of random colour and size on a cluttered background.
- `compare`: two objects far apart; the class says whether they have the same shape, the same colour
  and the same size (three comparisons between distant tokens, the classic same-different problem).
  Each question is learnt in a sudden jump, if at all: runs often stop near 0.5 with one of the
  three at chance, which one depending on the run (docs/own-data.md).

Every image is a pure function of (task, seed, split, index): rerunning writes the same files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 32
Rng = np.random.Generator
Draw = Callable[[Rng, int], Image.Image]  # (rng, label) -> one RGB image


def _background(rng: Rng) -> Image.Image:
    """Low-contrast noise with a random tint: no task can be solved from the background alone."""
    base = rng.integers(40, 200, size=3)
    noise = rng.normal(0, 18, size=(SIZE, SIZE, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def _colour(rng: Rng) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in rng.integers(0, 256, size=3))
    return r, g, b


# --- relations ---------------------------------------------------------------------------------------

RELATIONS = ("left", "right", "above", "below")
RELATION_CLASSES = tuple(f"circle-{r}-{s}" for s in ("larger", "smaller") for r in RELATIONS)


def _relation_centres(rng: Rng, relation: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """Centres (x, y) of circle and square, the circle on `relation`'s side with a clear margin."""
    near, far = int(rng.integers(6, 12)), int(rng.integers(20, 26))
    other = (int(rng.integers(6, 26)), int(rng.integers(6, 26)))
    if relation in ("left", "right"):
        circle_x, square_x = (near, far) if relation == "left" else (far, near)
        return (circle_x, other[0]), (square_x, other[1])
    circle_y, square_y = (near, far) if relation == "above" else (far, near)
    return (other[0], circle_y), (other[1], square_y)


def draw_relation(rng: Rng, label: int) -> Image.Image:
    relation, larger = RELATIONS[label % 4], label < 4
    img = _background(rng)
    draw = ImageDraw.Draw(img)
    big, small = int(rng.integers(5, 7)), int(rng.integers(2, 4))
    circle_r, square_r = (big, small) if larger else (small, big)
    (cx, cy), (sx, sy) = _relation_centres(rng, relation)
    draw.ellipse((cx - circle_r, cy - circle_r, cx + circle_r, cy + circle_r), fill=_colour(rng))
    draw.rectangle((sx - square_r, sy - square_r, sx + square_r, sy + square_r), fill=_colour(rng))
    return img


# --- textures ----------------------------------------------------------------------------------------

TEXTURE_CLASSES = ("horizontal", "vertical", "diagonal-down", "diagonal-up", "checks", "dots", "rings", "blotches")


def _texture_field(rng: Rng, name: str, tilt_deg: float = 0.0, periods: tuple[float, float] = (4, 9)) -> np.ndarray:
    """A pattern in [0, 1] of shape (SIZE, SIZE); `tilt_deg` > 0 turns it by a random angle within
    +-tilt_deg (drawn only then: `textures` images stay what they were)."""
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64)
    if tilt_deg > 0:
        angle = np.deg2rad(float(rng.uniform(-tilt_deg, tilt_deg)))
        x, y = (x * np.cos(angle) - y * np.sin(angle), x * np.sin(angle) + y * np.cos(angle))
    period, phase = float(rng.uniform(*periods)), float(rng.uniform(0, 2 * np.pi))
    wave: dict[str, Callable[[], np.ndarray]] = {
        "horizontal": lambda: np.sin(2 * np.pi * y / period + phase),
        "vertical": lambda: np.sin(2 * np.pi * x / period + phase),
        "diagonal-down": lambda: np.sin(2 * np.pi * (x + y) / (period * 1.4) + phase),
        "diagonal-up": lambda: np.sin(2 * np.pi * (x - y) / (period * 1.4) + phase),
        "checks": lambda: np.sign(np.sin(2 * np.pi * x / period + phase) * np.sin(2 * np.pi * y / period)),
        "dots": lambda: (np.sin(2 * np.pi * x / period + phase) * np.sin(2 * np.pi * y / period + phase)) ** 8 * 2 - 1,
        "rings": lambda: np.sin(2 * np.pi * np.hypot(x - rng.uniform(8, 24), y - rng.uniform(8, 24)) / period),
    }
    if name == "blotches":  # smooth noise: a coarse grid upsampled
        coarse = rng.normal(size=(5, 5))
        field = np.asarray(Image.fromarray(coarse.astype(np.float32)).resize((SIZE, SIZE), Image.Resampling.BICUBIC))
        return np.asarray((field - field.min()) / (np.ptp(field) + 1e-6))
    return np.asarray((wave[name]() + 1) / 2)


def draw_texture(rng: Rng, label: int) -> Image.Image:
    field = _texture_field(rng, TEXTURE_CLASSES[label])[..., None]
    a, b = np.array(_colour(rng), dtype=np.float64), np.array(_colour(rng), dtype=np.float64)
    if np.abs(a - b).sum() < 150:  # two near-equal colours would erase the pattern
        b = 255 - a
    pixels = a * field + b * (1 - field) + rng.normal(0, 12, size=(SIZE, SIZE, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


# --- faint textures ----------------------------------------------------------------------------------
# The same eight classes, far from the ceiling `textures` sits at (every model there scores 0.99+, so
# an ensemble has nothing to add): two close colours, heavy noise, patterns turned by up to 15 degrees
# and a wider range of periods.


def draw_faint_texture(rng: Rng, label: int) -> Image.Image:
    field = _texture_field(rng, TEXTURE_CLASSES[label], tilt_deg=15.0, periods=(3, 11))[..., None]
    a = rng.uniform(60, 196, size=3)
    b = np.clip(a + rng.choice((-1, 1), size=3) * rng.uniform(FAINT_DIFF[0], FAINT_DIFF[1], size=3), 0, 255)
    pixels = a * field + b * (1 - field) + rng.normal(0, FAINT_NOISE, size=(SIZE, SIZE, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


FAINT_DIFF, FAINT_NOISE = (20.0, 50.0), 16.0  # colour difference per channel, noise sigma (tuned: docs/own-data.md)


# --- counting ----------------------------------------------------------------------------------------

COUNT_CLASSES = tuple(str(n) for n in range(1, 9))


def draw_count(rng: Rng, label: int) -> Image.Image:
    img = _background(rng)
    draw = ImageDraw.Draw(img)
    placed: list[tuple[int, int]] = []
    while len(placed) < label + 1:  # blobs at least 6 px apart, so each is countable
        x, y = (int(v) for v in rng.integers(3, SIZE - 3, size=2))
        if all((x - px) ** 2 + (y - py) ** 2 >= 36 for px, py in placed):
            placed.append((x, y))
    for x, y in placed:
        r = int(rng.integers(1, 3))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=_colour(rng))
    return img


# --- compare -----------------------------------------------------------------------------------------

PALETTE = ((220, 40, 40), (40, 180, 60), (50, 80, 230), (235, 215, 40))  # far apart: "same colour" is exact
COMPARE_CLASSES = tuple(
    f"shape-{a}_colour-{b}_size-{c}" for a in ("same", "diff") for b in ("same", "diff") for c in ("same", "diff")
)
RADII = (3, 6)  # small, large: twice apart, so "same size" needs no fine judgement
# Triangle and square, not circle and square: at radius 3 a circle differs from a square in four
# corner pixels, and every model (the reference CNN too) answered "same shape?" at chance.


def _two_apart(rng: Rng, r1: int, r2: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Centres of two objects inside the image with at least 4 px between their edges."""
    while True:
        a = (int(rng.integers(r1 + 1, SIZE - r1 - 1)), int(rng.integers(r1 + 1, SIZE - r1 - 1)))
        b = (int(rng.integers(r2 + 1, SIZE - r2 - 1)), int(rng.integers(r2 + 1, SIZE - r2 - 1)))
        if max(abs(a[0] - b[0]), abs(a[1] - b[1])) >= r1 + r2 + 4:
            return a, b


def _pair(rng: Rng, same: bool, choices: int) -> tuple[int, int]:
    first = int(rng.integers(choices))
    return first, first if same else (first + int(rng.integers(1, choices))) % choices


@dataclass(frozen=True)
class Shape:
    kind: str  # "triangle" or "square"
    colour: int  # index into PALETTE
    radius: int
    centre: tuple[int, int]


def compare_shapes(rng: Rng, label: int) -> tuple[Shape, Shape]:
    """The two objects of a `compare` image: class `label` fixes which of shape, colour and size agree."""
    same_shape, same_colour, same_size = label < 4, label % 4 < 2, label % 2 == 0  # COMPARE_CLASSES' order
    kinds, colours = _pair(rng, same_shape, 2), _pair(rng, same_colour, len(PALETTE))
    radii = tuple(RADII[i] for i in _pair(rng, same_size, 2))
    centres = _two_apart(rng, radii[0], radii[1])
    first, second = (Shape(("triangle", "square")[kinds[i]], colours[i], radii[i], centres[i]) for i in range(2))
    return first, second


def draw_compare(rng: Rng, label: int) -> Image.Image:
    shapes = compare_shapes(rng, label)
    img = _background(rng)
    draw = ImageDraw.Draw(img)
    for shape in shapes:
        fill = np.clip(np.array(PALETTE[shape.colour]) + rng.integers(-12, 13, size=3), 0, 255)
        (x, y), r = shape.centre, shape.radius
        colour = tuple(int(v) for v in fill)
        if shape.kind == "square":
            draw.rectangle((x - r, y - r, x + r, y + r), fill=colour)
        else:  # apex up: half the square's area, a different outline at either size
            draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    return img


@dataclass(frozen=True)
class Task:
    classes: tuple[str, ...]
    draw: Draw
    about: str


TASKS: dict[str, Task] = {
    "relations": Task(RELATION_CLASSES, draw_relation, "where a circle is relative to a square, and which is larger"),
    "textures": Task(TEXTURE_CLASSES, draw_texture, "stripes, diagonals, checks, dots, rings, blotches"),
    "faint-textures": Task(TEXTURE_CLASSES, draw_faint_texture, "the textures, faint, noisy and turned"),
    "counting": Task(COUNT_CLASSES, draw_count, "how many blobs (1-8) on a cluttered background"),
    "compare": Task(COMPARE_CLASSES, draw_compare, "two objects: same or different shape, colour and size"),
}
SPLIT_SEEDS = {"train": 0, "val": 1}


def image(task: str, seed: int, split: str, index: int) -> tuple[Image.Image, int]:
    """Image `index` of a split and its label; balanced classes (index modulo the class count)."""
    spec = TASKS[task]
    label = index % len(spec.classes)
    rng = np.random.default_rng([seed, SPLIT_SEEDS[split], index])
    return spec.draw(rng, label), label


def write(task: str, out: Path, train: int, val: int, seed: int = 0) -> dict[str, int]:
    """Write OUT/train/CLASS/NNNNNN.png and OUT/val/CLASS/NNNNNN.png; returns images per split."""
    if task not in TASKS:
        raise ValueError(f"no generated task {task!r}: one of {', '.join(TASKS)}")
    spec = TASKS[task]
    for split, count in (("train", train), ("val", val)):
        for name in spec.classes:
            (out / split / name).mkdir(parents=True, exist_ok=True)
        for index in range(count):
            img, label = image(task, seed, split, index)
            img.save(out / split / spec.classes[label] / f"{index:06d}.png")
    return {"train": train, "val": val}
