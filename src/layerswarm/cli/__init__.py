"""The `layerswarm` command line: one module per command, each registering its own subparser.

A command module has `register(subparsers)`, which adds the command's parser and binds its entry point
with `set_defaults(func=...)`; main() parses and calls it. Modules import heavy things (torch, the
servers) inside their entry points, so that building the parser stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from typing import Any

from layerswarm import __version__

from . import logs
from .base import Parser, UsageError, add_log_flags, one_line

# Command name -> its module, in --help's order. Only the module of the command being run is imported
# (a health probe every few seconds must not pay for the coordinator's settings or the chaos harness);
# --help and unknown commands import them all.
COMMANDS = (
    "train",
    "family",
    "eval",
    "node",
    "coordinator",
    "up",
    "chaos",
    "bench",
    "probe",
    "token",
    "zoo",
    "samples",
    "datasets",
    "depth",
    "import-hf",
)

EXAMPLES = """\
examples:
  layerswarm up                                   # a local swarm from the shipped weights, end to end
  layerswarm zoo                                  # the shipped models
  layerswarm samples samples/                     # labelled images to send to a swarm
  layerswarm train --data shapes --variant layershuffle --out runs/ls
  layerswarm family --base runs/base --members 4 --out runs/family
  layerswarm eval runs/family/member-* --json report.json --plots figures/
  layerswarm token swarm.token                    # a swarm token: nothing serves a LAN without one
  layerswarm node --model-dir runs/family/member-0 --block 3 --host 0.0.0.0 --token-file swarm.token
  layerswarm coordinator --model-dir runs/family/member-0 --http-port 8080 --config swarm.toml
"""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with `only` the top level and that one command (faster to build)."""
    parser = Parser(
        prog="layerswarm",
        description="Distributed edge inference: every transformer block is its own network node, and a "
        "coordinator routes through them in any order.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"layerswarm {__version__}")
    add_log_flags(parser, top=True)  # each command takes them too, after its name
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name in (only,) if only in COMMANDS else COMMANDS:
        importlib.import_module(f"{__name__}.{name.replace('-', '_')}").register(sub)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command argv names (the first word that is one), if any: the only parser worth building."""
    return next((word for word in argv if word in COMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_in(argv)).parse_args(argv)
    args.argv = argv  # commands that re-execute themselves in a private network namespace need it
    args.command_line = "layerswarm " + " ".join(argv)  # recorded in manifests: how a model was made
    logs.configure(args.log_level, args.log_format)
    try:
        status: int = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then the BrokenPipeError below
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as exc:
        return _stdout_closed() if _stdout_is_broken() else _usage_error(args.command, str(exc))
    except UsageError as exc:
        return _usage_error(args.command, str(exc))
    except ModuleNotFoundError as exc:  # a lean install (no torch, no HTTP stack) asked for more
        return _usage_error(args.command, missing_extra(exc))
    except (ValueError, OSError) as exc:  # ModelDirError is a ValueError; FileNotFoundError an OSError
        return _usage_error(args.command, one_line(str(exc)))
    return status


# What a package left out of the base install belongs to: `pip install layerswarm` is a lean node
# (numpy engine); the coordinator, `up`, training and the torch engine need an extra (pyproject.toml).
EXTRA_OF = {
    "torch": "coordinator",
    "fastapi": "coordinator",
    "fastapi_offline": "coordinator",
    "uvicorn": "coordinator",
    "multipart": "coordinator",
    "PIL": "coordinator",
    "tqdm": "coordinator",
    "httpx": "coordinator",
    "tenacity": "coordinator",
    "tokenizers": "coordinator",
    "sse_starlette": "coordinator",
    "httpx_sse": "coordinator",
    "sklearn": "train",
    "matplotlib": "train",
}


def missing_extra(exc: ModuleNotFoundError) -> str:
    """The one line for a command that needs a package this install lacks; others re-raise."""
    root = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(root)
    if extra is None:
        raise exc
    return (
        f"needs {root}, which this install leaves out (layerswarm alone is a lean node): "
        f"pip install 'layerswarm[{extra}]'"
    )


def _usage_error(command: str, message: str) -> int:
    print(f"layerswarm {command}: error: {message}", file=sys.stderr)
    return 2


def _stdout_is_broken() -> bool:
    """Whether the BrokenPipeError was stdout's (its reader gone: poll says POLLERR), not some socket's."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or a stdout without a descriptor
        return True


def _stdout_closed() -> int:
    """The reader of stdout went away (`layerswarm zoo --json | head -2`): stop quietly, as a command
    killed by SIGPIPE would (status 128 + 13), and point stdout at /dev/null so that the interpreter's
    own flush at exit finds nothing to complain about (Python docs, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + 13


def node_settings_from_argv(argv: list[str]) -> Any:
    """`layerswarm node` arguments to NodeSettings, with the CLI's logging (for harness/faults.py, the
    test-only faulty node, which must parse exactly what the real node parses)."""
    from .base import load_settings

    args = build_parser("node").parse_args(["node", *argv])
    logs.configure(args.log_level, args.log_format)
    return load_settings(args)
