"""What every command module shares: the parser class, settings-backed flags, and usage errors.

A command module defines `register(subparsers)`, which adds its parser and binds its entry point with
`set_defaults(func=...)`. Flags of node and coordinator settings take their defaults from the settings
class (stated once, shown in --help) and only flags actually given override the config file and the
environment.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pydantic-settings costs ~0.1 s to import: only commands with settings pay it
    from pydantic import ValidationError

    from layerswarm.wire.settings import ProcessSettings

Subparsers = Any  # argparse's _SubParsersAction is private; its add_parser is all a command module needs


class UsageError(Exception):
    """An operator mistake: main() prints `layerswarm COMMAND: error: MESSAGE` and exits 2."""


WORKER_TRACEBACK = "Original Traceback (most recent call last):"  # in an error a DataLoader worker raised


def one_line(message: str) -> str:
    """An error's message fit for `layerswarm COMMAND: error: MESSAGE`. An exception raised in a DataLoader
    worker reaches the main process as "Caught ValueError in DataLoader worker process 0." plus the
    worker's whole traceback; that becomes the worker's own message (its first line). Others are kept."""
    if WORKER_TRACEBACK not in message:
        return message
    lines = message.splitlines()
    last = max(i for i, line in enumerate(lines) if line.endswith("Traceback (most recent call last):"))
    raised = next((line for line in lines[last + 1 :] if line.strip() and not line[0].isspace()), lines[0])
    return re.sub(r"^[A-Za-z_][\w.]*: ", "", raised, count=1)  # "PIL.UnidentifiedImageError: ..." -> "..."


class Parser(argparse.ArgumentParser):
    """argparse, but errors name the command and exit 2 without a traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps hand-wrapped descriptions and appends every plain argparse default to its help (not a
    None default: such a flag's help says itself what happens when it is not given; not the default of
    an on/off flag either: `--no-reference (default: True)` would read as if the reference were skipped)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def add_log_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and --log-format. The top-level parser holds the defaults (the environment's, else
    WARNING and text); each command accepts them too (after its name) without a default of its own, so
    that one given on either side counts."""
    level, fmt = os.environ.get("LAYERSWARM_LOG", "WARNING"), os.environ.get("LAYERSWARM_LOG_FORMAT", "text")
    parser.add_argument(
        "--log-level",
        default=level if top else argparse.SUPPRESS,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help=f"logging verbosity (default: {level}, from $LAYERSWARM_LOG or WARNING)",
    )
    parser.add_argument(
        "--log-format",
        default=fmt if top else argparse.SUPPRESS,
        choices=["text", "json"],
        help=f"log lines as text, or one JSON object per line (default: {fmt}, from $LAYERSWARM_LOG_FORMAT or text)",
    )


def add_command(sub: Subparsers, name: str, func: Callable[[argparse.Namespace], int], **kw: Any) -> Parser:
    parser: Parser = sub.add_parser(name, formatter_class=HelpFormatter, **kw)
    add_log_flags(parser, top=False)
    parser.set_defaults(func=func)
    return parser


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: an integer of at least `low`; the error says so (and argparse names the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number of at least 0 (argparse names the flag in its error)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def probability_below_one(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    value = _finite(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


def share_of_schedule(text: str) -> float:
    """argparse type: a share in [0, 1]."""
    value = _finite(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share from 0 to 1, got {text}")
    return value


def folder(text: str) -> Path:
    """argparse type: a folder, or a path where one can be made (neither it nor a parent is a file)."""
    path = Path(text)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == path else f" ({existing} is)"
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder{where}")
    return path


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


class SettingsFlags:
    """The flags of one settings class: defaults read from it, and which flag sets which setting."""

    def __init__(self, parser: argparse.ArgumentParser, settings: type[ProcessSettings]) -> None:
        self.parser, self.settings = parser, settings
        self.target: argparse.ArgumentParser | argparse._ArgumentGroup = parser  # where add() puts flags
        self.flag_of: dict[str, str] = {}
        parser.set_defaults(settings_flags=self)  # the command's run() loads through it: load_settings(args)
        parser.add_argument(
            "--config",
            type=existing_file,
            default=argparse.SUPPRESS,
            metavar="FILE",
            help=f"TOML file whose [{settings.section}] table sets any setting below by its key "
            f"(environment: {settings.env_name('KEY')}); the command line overrides both (default: none)",
        )

    def group(self, title: str, description: str | None = None) -> argparse._ArgumentGroup:
        """Start a section of --help: the flags added from here on are listed under `title` (returned, for
        flags without a setting)."""
        self.target = self.parser.add_argument_group(title, description)
        return self.target

    def add(self, flag: str, key: str, help: str | None = None, **kw: Any) -> None:
        """A flag for setting `key`; absent from the namespace unless given (so lower sources still count).
        Its help is the setting's description (stated once, in the settings class) unless the flag says
        something of its own (a --no-X flag)."""
        field = self.settings.model_fields[key]
        help = help or field.description
        if not help:
            raise ValueError(f"setting {key} has no description for {flag}'s help")
        if kw.get("action") in ("store_true", "store_false"):
            note = f"key {key}"
        elif field.is_required():
            note = f"required; key {key}"
        else:
            default = field.get_default(call_default_factory=True)
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            note = f"default: {shown if shown not in (None, '') else 'none'}; key {key}"
        if kw.get("action") not in ("store_true", "store_false") and "choices" not in kw:
            kw.setdefault("metavar", flag.lstrip("-").upper().replace("-", "_"))
        self.target.add_argument(flag, dest=key, default=argparse.SUPPRESS, help=f"{help} ({note})", **kw)
        self.flag_of[key] = flag

    def load(self, args: argparse.Namespace, **fixed: Any) -> Any:
        """The settings: defaults < --config < environment < flags given. Mistakes become UsageError."""
        from pydantic import ValidationError

        from layerswarm.wire.settings import TOMLDecodeError

        given = {k: _tupled(getattr(args, k)) for k in self.flag_of if hasattr(args, k)}
        config: Path | None = getattr(args, "config", None)
        try:
            return self.settings.load(config, **given, **fixed)
        except ValidationError as exc:
            raise UsageError(self._explain(exc, config)) from None
        except TOMLDecodeError as exc:
            raise UsageError(f"--config {config}: not valid TOML: {exc}") from None

    def _explain(self, exc: ValidationError, config: Path | None) -> str:
        errors = exc.errors()
        first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])  # a typo explains the rest
        key = str(first["loc"][0]) if first["loc"] else ""
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            return f"--config {config}: unknown setting {key!r} in [{self.settings.section}]"
        if not key:
            return message
        return f"{self.flag_of.get(key, key)} (setting {key}, env {self.settings.env_name(key)}): {message}"


def load_settings(args: argparse.Namespace, **fixed: Any) -> Any:
    """The parsed command's settings object (see SettingsFlags.load)."""
    flags: SettingsFlags = args.settings_flags
    return flags.load(args, **fixed)


def _tupled(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def ensure_can_listen(host: str, port: int | None, host_flag: str, port_flag: str) -> None:
    """Refuse an address this machine cannot listen on, before any start-up work, naming the flag at
    fault (servers would otherwise fail deep inside gRPC or uvicorn with a traceback): a port another
    process holds, or a host that is not one of this machine's addresses. Port 0 means any free port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            probe.bind((host, port or 0))
        except socket.gaierror as exc:
            raise UsageError(f"{host_flag} {host}: not an address of this machine ({exc.strerror})") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"{port_flag} {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
            raise UsageError(f"{host_flag} {host}: cannot listen on {host} ({exc.strerror})") from None
