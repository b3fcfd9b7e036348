"""What a generation caller asks (GenerationOptions), and the checks that refuse what no node could serve
before anything reaches one (a prompt over the context, max_tokens past the limit, a token id outside
the vocabulary): the caller's mistakes never count against a node.

Every API (native /v1/generate, OpenAI's completions and chat) builds one GenerationOptions from its
own validated body; the generator reads it as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.generate import Sampling

from ..routing.request import InvalidRequest
from ..settings import SPECULATION_MAX_K as MAX_DRAFT

ORDERS = ("sequential", "shuffle")  # the route's block order (shuffle: shuffle-robust families only)
MAX_STOPS = 8  # the caller's (OpenAI allows 4) and a chat template's own
MAX_STOP_CHARS = 256


class InvalidGeneration(InvalidRequest):
    """A generation request no node could serve: the message, the parameter at fault and a short code
    (OpenAI's error format carries both; the native API shows the message)."""

    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Speculation:
    """Self-speculative decoding for one stream: k drafts a verify trip (0: off, plain decoding), or
    adaptive (k chosen each round from the stream's acceptance and round-trip times: kcontrol.py)."""

    k: int = 0
    adaptive: bool = False

    @property
    def on(self) -> bool:
        return self.adaptive or self.k > 0

    def describe(self) -> str:
        return "auto" if self.adaptive else str(self.k) if self.k else "off"


OFF = Speculation()


def parse_speculation(value: object) -> Speculation:
    """The API's and the settings' spelling: "off" | "auto" | k (0..MAX_DRAFT, 0 is off) | {"k": k or "auto"}.
    Raises InvalidGeneration naming `speculation`."""
    if isinstance(value, dict):
        if set(value) != {"k"}:
            raise _bad_speculation(f"an object takes one key, k; got {sorted(value)}")
        value = value["k"]
    if value is None or value == "off":
        return OFF
    if value == "auto":
        return Speculation(adaptive=True)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_speculation(f"got {value!r}")
    if not 0 <= value <= MAX_DRAFT:
        raise _bad_speculation(f"k must be 0 to {MAX_DRAFT}, got {value}")
    return Speculation(k=value)


@dataclass(frozen=True)
class EarlyExit:
    """Per-token early exit for one stream (lossy, CALM): a token leaves the route after the first block
    at which the head's top probability reaches `threshold` (None: the model's calibrated one), once
    `min_blocks` ran. `on` False: every token runs the whole route."""

    on: bool = False
    threshold: float | None = None

    def describe(self) -> str:
        return "off" if not self.on else "calibrated" if self.threshold is None else str(self.threshold)


NO_EXIT = EarlyExit()


def parse_early_exit(value: object) -> EarlyExit:
    """The API's and the settings' spelling: "off" | false | "on" | true (the model's calibrated threshold)
    | a threshold in (0, 1] (a number, or its text). Raises InvalidGeneration naming `early_exit`."""
    if value is None or value is False or value == "off":
        return NO_EXIT
    if value is True or value == "on":
        return EarlyExit(on=True)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _bad_early_exit(f"got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad_early_exit(f"got {value!r}")
    if not 0.0 < float(value) <= 1.0:  # NaN fails this too
        raise _bad_early_exit(f"a threshold must be over 0 and at most 1, got {value}")
    return EarlyExit(on=True, threshold=float(value))


def _bad_early_exit(detail: str) -> InvalidGeneration:
    return InvalidGeneration(
        f'early_exit must be "off", "on" (the model\'s calibrated threshold) or a threshold over 0 and at most 1: '
        f"{detail}",
        "early_exit",
        "invalid_early_exit",
    )


def _bad_speculation(detail: str) -> InvalidGeneration:
    return InvalidGeneration(
        f'speculation must be "off", "auto", a number of drafts 0 to {MAX_DRAFT}, or {{"k": ...}}: {detail}',
        "speculation",
        "invalid_speculation",
    )


@dataclass(frozen=True)
class GenerationOptions:
    """What the caller asked for one stream. max_tokens None: the server's default (bounded by the
    context); temperature 0: greedy; same seed, same text (models/lm/generate.py's Sampling)."""

    max_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    order: str = "sequential"
    speculation: Speculation | None = None  # None: the server's default (--speculation)
    early_exit: EarlyExit | None = None  # None: the server's default (--early-exit)

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


def check_generation(
    prompt: Sequence[int], options: GenerationOptions, cfg: LMConfig, max_new_tokens: int, default_max_tokens: int
) -> int:
    """The number of tokens the stream may generate; raises InvalidGeneration for what no node could serve."""
    if not prompt:
        raise InvalidGeneration("the prompt is empty", "prompt", "empty_prompt")
    bad = next((t for t in prompt if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise InvalidGeneration(
            f"token id {bad} is outside the vocabulary of {cfg.vocab_size}", "prompt", "invalid_token"
        )
    context = cfg.max_seq_len
    if len(prompt) >= context:
        raise InvalidGeneration(
            f"the prompt has {len(prompt)} tokens; the model's context is {context} tokens, with room for at least "
            "one generated token",
            "prompt",
            "context_length_exceeded",
        )
    asked = options.max_tokens
    if asked is not None and asked > max_new_tokens:
        raise InvalidGeneration(
            f"max_tokens {asked} is over this server's limit of {max_new_tokens}", "max_tokens", "max_tokens_exceeded"
        )
    if asked is not None and len(prompt) + asked > context:
        raise InvalidGeneration(
            f"the model's context is {context} tokens; the prompt has {len(prompt)} and max_tokens asks {asked} more",
            "max_tokens",
            "context_length_exceeded",
        )
    _check_sampling(options, cfg)
    room = context - len(prompt)
    return asked if asked is not None else min(default_max_tokens, max_new_tokens, room)


def _check_sampling(options: GenerationOptions, cfg: LMConfig) -> None:
    try:
        options.sampling()
    except ValueError as exc:
        raise InvalidGeneration(str(exc), "temperature", "invalid_sampling") from None
    if len(options.stop) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in options.stop):
        raise InvalidGeneration(
            f"stop: at most {MAX_STOPS} sequences, each 1 to {MAX_STOP_CHARS} characters", "stop", "invalid_stop"
        )
    if options.order not in ORDERS:
        raise InvalidGeneration(f"order must be one of {', '.join(ORDERS)}", "order", "invalid_order")
    if options.order == "shuffle" and not cfg.shuffle_robust:
        raise InvalidGeneration(
            f"order shuffle needs a shuffle-robust family; this one is {cfg.variant}", "order", "invalid_order"
        )
