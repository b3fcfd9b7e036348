"""Generated tasks whose answers are checked exactly: a prompt, and the one right continuation.

    add    47+8=           -> 55        addition with a carry (the tens digit depends on the units)
    rev    rev:58213=      -> 31285     reversal: each answer digit is read from a mirrored position
    sort   sort:6291=      -> 1269      sorting digits: compare everything with everything
    kv     c7a2f9?a=       -> 2         lookup: find the key, then read the digit after it (two steps)

Each needs attention to find and combine the right prompt tokens (no answer can be guessed from a
prompt's surface), so a model missing blocks, or a conventionally trained one run in another block
order, gets answers wrong, and exact match shows it where perplexity blurs it. Train and test
examples are drawn from one seeded stream and never repeat across the split.

Strings are digits, and the kv keys single letters between digits: the tokenizer splits every digit into a
token of its own (training/lm/tokenizer.py), so whatever merges BPE learns from a text corpus, each
character a task moves is one token.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

TASKS = ("add", "rev", "sort", "kv")
LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # ends with "=": the model writes the answer after it
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(100), rng.randrange(10)
    return f"{a}+{b}=", str(a + b)


def _rev(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choices(string.digits, k=rng.randint(3, 7)))
    return f"rev:{digits}=", digits[::-1]


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choices(string.digits, k=rng.randint(3, 6)))
    return f"sort:{digits}=", "".join(sorted(digits))


def _kv(rng: random.Random) -> tuple[str, str]:
    keys = rng.sample(LETTERS, rng.randint(2, 3))
    values = [rng.choice(string.digits) for _ in keys]
    asked = rng.randrange(len(keys))
    pairs = "".join(k + v for k, v in zip(keys, values, strict=True))
    return f"{pairs}?{keys[asked]}=", values[asked]


MAKERS: dict[str, Callable[[random.Random], tuple[str, str]]] = {"add": _add, "rev": _rev, "sort": _sort, "kv": _kv}


def make_examples(
    n_train: int, n_test: int, seed: int = 0, tasks: tuple[str, ...] = TASKS
) -> tuple[list[Example], list[Example]]:
    """n_train and n_test examples, the tasks in turn, no prompt in both (test prompts drawn first)."""
    rng = random.Random(seed)
    test, seen = _draw(n_test, tasks, rng, set())
    train, _ = _draw(n_train, tasks, rng, seen)
    return train, test


def _draw(count: int, tasks: tuple[str, ...], rng: random.Random, avoid: set[str]) -> tuple[list[Example], set[str]]:
    out: list[Example] = []
    seen = set(avoid)
    misses = 0
    while len(out) < count:
        task = tasks[len(out) % len(tasks)]
        prompt, answer = MAKERS[task](rng)
        if prompt in avoid:  # a test prompt: never train on it
            misses += 1
            if misses > 100 * (count + 1):
                raise ValueError("the tasks ran out of distinct prompts: ask for fewer examples")
            continue
        seen.add(prompt)
        out.append(Example(task, prompt, answer))
    return out, seen
