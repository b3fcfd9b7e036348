"""The documentation against the code (issues 46 and 47): every `layerswarm ...` command that README.md and
docs/*.md show parses with the real parser, the README stays a five-minute read, every relative link
points at a file (and heading) that exists, and no --help prints a doubled percent sign.

A documented command is a line of a shell code block (```bash, ```sh, ```console or unlabelled; in ```text
blocks only `$ ` prompt lines) or an inline code span, that starts with `layerswarm ` or
`.venv/bin/layerswarm `. Usage-style spans (`[--epochs N]`, `DIR|hf:PATH`, `--calibrate[-only]`) are
expanded to one concrete command; UPPERCASE placeholders become a value the flag's type accepts; files a
flag must find (`--config`, `--token-file`, `imagefolder:DIR`) are made in a scratch folder. A command may
leave out required arguments only where it says so with `...`.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from layerswarm.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
COMMAND_PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINKED_PAGES = [
    *COMMAND_PAGES,
    ROOT / "DEVELOPERS.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs" / "results").rglob("*.md")),
    *sorted((ROOT / "src" / "layerswarm").rglob("README.md")),
    *sorted((ROOT / "deploy").rglob("*.md")),
]
README_MAX_BYTES = 25_000  # "a README a user reads in five minutes, at most 25 KB"
FEWEST_COMMANDS = 80  # the docs show more; fewer found means the extraction broke, not that the docs are fine

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
INLINE = re.compile(r"`((?:\.venv/bin/)?layerswarm [^`]+)`")
PLACEHOLDER = re.compile(r"^(<[^>]+>|[A-Z][A-Z0-9_]*(\.\.\.)?)$")
SHELL_WORDS = {"do", "then", "else", "time", "{", "(", "!", "exec"}
CONTROL = {"|", "||", "&", "&&", ";", ";;", "(", ")"}
RUNS_LAYERSWARM = re.compile(r"(^|[\s;&|(])(\S*/)?layerswarm\s")


@dataclass(frozen=True)
class Documented:
    """One command as a page shows it: where, and the words after `layerswarm`."""

    page: str
    line: int
    text: str
    words: tuple[str, ...]
    elided: bool  # `...` in it: the rest is left out on purpose
    inline: bool  # in prose: it names a command and flags, and may leave out what they require


def without_fences(text: str) -> str:
    """The page with fenced blocks blanked (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def without_code(text: str) -> str:
    """The page with fenced blocks blanked and inline code removed: what is left can hold links."""
    return re.sub(r"`[^`\n]*`", "", without_fences(text))


def _substitute_shell(line: str) -> str:
    """$((arithmetic)) -> 1, $(command) -> nothing as a word or `x` inside one, ${VAR:-default} -> default,
    $VAR -> 0: what the shell would put there, close enough for argument parsing."""
    out, i = [], 0
    while i < len(line):
        if line.startswith("$(", i):
            depth, j = 0, i + 1
            while j < len(line):
                depth += {"(": 1, ")": -1}.get(line[j], 0)
                if depth == 0:
                    break
                j += 1
            arithmetic = line.startswith("$((", i)
            before = line[i - 1] if i else " "
            after = line[j + 1] if j + 1 < len(line) else " "
            standalone = before in " \t" and after in " \t"
            out.append("1" if arithmetic else ("" if standalone else "x"))
            i = j + 1
            continue
        out.append(line[i])
        i += 1
    text = "".join(out)
    text = re.sub(r"\$\{[A-Za-z_]\w*:-([^}]*)\}", r"\1", text)
    return re.sub(r"\$\{?[A-Za-z_]\w*\}?", "0", text)


def _segments(line: str) -> list[list[str]]:
    """The simple commands of one shell line, redirections dropped."""
    lexer = shlex.shlex(_substitute_shell(line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments: list[list[str]] = [[]]
    tokens = list(lexer)
    skip = 0
    for index, token in enumerate(tokens):
        if skip:
            skip -= 1
            continue
        if token in CONTROL:
            segments.append([])
        elif set(token) <= set("<>&|") and ("<" in token or ">" in token):  # a redirection and its target
            if segments[-1] and segments[-1][-1].isdigit():
                segments[-1].pop()  # the descriptor of 2>&1
            skip = 1 if index + 1 < len(tokens) else 0
        else:
            segments[-1].append(token)
    return [s for s in segments if s]


def _layerswarm_words(segment: list[str]) -> list[str] | None:
    """The words after `layerswarm` when the segment runs it (after shell keywords and VAR=value)."""
    words = list(segment)
    while words and (words[0] in SHELL_WORDS or re.match(r"^[A-Za-z_]\w*=", words[0])):
        words.pop(0)
    if words and (words[0] == "layerswarm" or words[0].endswith("/layerswarm")):
        return words[1:]
    return None


def _usage_to_line(text: str) -> str:
    """An inline usage string as one concrete command: optional parts given, the first alternative taken."""
    text = " ".join(text.split())
    text = re.sub(r"(?<=[\w-])\[[^\]\s]*\]", "", text)  # --calibrate[-only] -> --calibrate
    previous = None
    while previous != text:
        previous, text = text, re.sub(r"\[([^\[\]]*)\]", r"\1", text)
    text = re.sub(r"(?<=\S)\|[^\s\]]+", "", text)  # DIR|hf:PATH -> DIR, star|relay|auto -> star
    return re.sub(r"(?<=\w)\.\.\.(?=\s|$)", "", text)  # DIR... -> DIR


def documented_commands(page: Path) -> list[Documented]:
    text = page.read_text()
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
    found: list[Documented] = []
    for block in FENCE.finditer(text):
        language, body = block.group(1), block.group(2)
        if language not in SHELL_BLOCKS and language != "text":
            continue
        first_line = text.count("\n", 0, block.start(2)) + 1
        lines = body.split("\n")
        logical: list[tuple[int, str]] = []
        for number, line in enumerate(lines, first_line):
            if logical and logical[-1][1].endswith("\\"):
                logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + line.strip())
            else:
                logical.append((number, line))
        for number, line in logical:
            stripped = line.strip()
            if stripped.startswith("$ "):
                stripped = stripped[2:]
            elif language == "text":
                continue  # output, not a command
            if not RUNS_LAYERSWARM.search(stripped):
                continue  # other tools' commands, diagrams
            for segment in _segments(stripped):
                words = _layerswarm_words(segment)
                if words is not None:
                    found.append(Documented(name, number, stripped, tuple(words), "..." in words, inline=False))
    prose = without_fences(text)
    for span in INLINE.finditer(prose):
        number = prose.count("\n", 0, span.start()) + 1
        line = _usage_to_line(span.group(1))
        for segment in _segments(line):
            words = _layerswarm_words(segment)
            if words is not None:
                found.append(Documented(name, number, span.group(1), tuple(words), "..." in words, inline=True))
    return found


def all_documented() -> list[Documented]:
    return [command for page in COMMAND_PAGES for command in documented_commands(page)]


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(command)
            return chosen if isinstance(chosen, argparse.ArgumentParser) else None
    return None


def _make(path_text: str, workdir: Path, *, folder: bool) -> str:
    """A file or folder a flag must find, made under the scratch folder; its path as the flag will see it."""
    path = workdir / path_text.lstrip("/")
    if folder:
        path.mkdir(parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    return str(path)


def _value_for(action: argparse.Action, value: str, workdir: Path) -> str:
    """The value to parse for a flag: a placeholder replaced by one its type accepts, files made."""
    if value == "..." or PLACEHOLDER.match(value):
        if action.choices:
            value = str(next(iter(action.choices)))
        elif getattr(action.type, "__name__", "") not in ("existing_file",):
            for candidate in ("1", "0.5", "shapes", "x"):
                try:
                    if action.type is not None:
                        action.type(candidate)  # type: ignore[operator]
                except (argparse.ArgumentTypeError, TypeError, ValueError):
                    continue
                value = candidate
                break
    kind = getattr(action.type, "__name__", "")
    if kind == "existing_file":
        return _make(value, workdir, folder=False)
    if kind == "api_keys":  # read at parse time: a file with one well-formed key
        path = Path(_make(value, workdir, folder=False))
        path.write_text("documented-example-key-0123456789abcdef\n")
        return str(path)
    if kind == "data_spec":
        spec, _, arg = value.partition(":")
        if spec == "imagefolder" and arg:
            return "imagefolder:" + _make(arg, workdir, folder=True)
        if spec in ("csv", "jsonl") and arg:
            return f"{spec}:" + _make(arg, workdir, folder=False)
    return value


def prepared(
    parser: argparse.ArgumentParser, words: tuple[str, ...], workdir: Path, *, mention: bool = False
) -> list[str]:
    """The argv to parse: placeholders filled (for flags and positionals), files made, a standalone `...`
    dropped. With `mention` (prose naming a flag: `layerswarm family --base`), a last flag without its
    value gets a placeholder one."""
    if not words:
        return []
    command, rest = words[0], list(words[1:])
    sub = _subparser(parser, command)
    if sub is None:
        return list(words)  # an unknown command: parsing says so
    options = sub._option_string_actions
    positionals = [a for a in sub._actions if not a.option_strings]
    argv = [command]
    i = 0
    while i < len(rest):
        word = rest[i]
        flag, eq, inline_value = word.partition("=")
        action = options.get(flag) if word.startswith("-") else None
        if action is not None and action.nargs != 0:
            if eq:
                argv.append(f"{flag}={_value_for(action, inline_value, workdir)}")
            elif i + 1 < len(rest):
                argv += [flag, _value_for(action, rest[i + 1], workdir)]
                i += 1
            else:
                argv += [flag, _value_for(action, "VALUE", workdir)] if mention else [flag]
        elif word.startswith("-") or word == "...":
            if word != "...":
                argv.append(word)  # a flag without a value, or unknown: parsing says which
        else:
            seen = sum(1 for w in argv[1:] if not w.startswith("-")) - _values_given(argv[1:], options)
            target = positionals[min(seen, len(positionals) - 1)] if positionals else None
            argv.append(_value_for(target, word, workdir) if target is not None else word)
        i += 1
    return argv


def _values_given(argv: list[str], options: dict[str, argparse.Action]) -> int:
    """How many words of argv are the values of flags (so the rest are positionals)."""
    values = 0
    for word in argv:
        action = options.get(word)
        if action is not None and action.nargs is None:
            values += 1
    return values


def parse_error(parser: argparse.ArgumentParser, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str | None:
    """None when argv parses (or asks for --help), else argparse's message."""
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        message = capsys.readouterr().err.strip().splitlines()
        if exc.code in (0, None):
            return None
        return message[-1] if message else f"exit status {exc.code}"
    return None


def test_every_documented_command_parses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # files the commands name are made here, never in the checkout
    parser = build_parser()
    commands = all_documented()
    assert len(commands) >= FEWEST_COMMANDS, f"only {len(commands)} documented commands found"
    failures = []
    for documented in commands:
        if not documented.words or re.match(r"^[A-Z<]", documented.words[0]) or documented.words[0].endswith(":"):
            continue  # `layerswarm X`, `layerswarm <command> --help`, `layerswarm up: ...`: a placeholder or output
        argv = prepared(parser, documented.words, tmp_path, mention=documented.inline)
        error = parse_error(parser, argv, capsys)
        if error and (documented.elided or documented.inline) and "the following arguments are required" in error:
            continue  # `layerswarm coordinator ... --policy network`, `layerswarm eval` in prose: left out on purpose
        if error:
            failures.append(f"{documented.page}:{documented.line}: {documented.text}\n    -> {error}")
    assert not failures, f"{len(failures)} of {len(commands)} documented commands fail to parse:\n" + "\n".join(
        failures
    )


def test_the_extraction_finds_what_a_broken_command_looks_like(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check catches the mistakes the issue found: a required flag left out, an unknown flag, a bad value;
    and accepts usage strings, placeholders and shell around a command."""
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "page.md"
    page.write_text(
        "Run `layerswarm family --base runs/b --epochs 30` or `layerswarm eval DIR... [--json FILE] [--plots DIR]`.\n"
        "```bash\n"
        "for b in 0 1; do\n"
        "  layerswarm node --model-dir zoo:shapes/layershuffle-0 --block $b --port $((50060 + b)) --no-advertise &\n"
        "done\n"
        "LAYERSWARM_NODE_PORT=1 layerswarm node --config swarm.toml --block 4 2>&1 | tee log  # a comment\n"
        "layerswarm train --data imagefolder:data/x --out runs/x \\\n"
        "    --epochs lots\n"
        "layerswarm coordinator ... --policy network\n"
        "layerswarm coordinator --no-such-flag\n"
        "```\n"
        "```text\n$ layerswarm up --json\nlayerswarm up: starting 16 nodes\n```\n"
    )
    found = documented_commands(page)
    parser = build_parser()
    verdicts = {" ".join(d.words): parse_error(parser, prepared(parser, d.words, tmp_path), capsys) for d in found}
    assert len(found) == 8, verdicts  # output lines of a text block are not commands
    assert "required: --out" in str(verdicts["family --base runs/b --epochs 30"])
    assert verdicts["eval DIR --json FILE --plots DIR"] is None
    assert verdicts["node --model-dir zoo:shapes/layershuffle-0 --block 0 --port 1 --no-advertise"] is None
    assert verdicts["node --config swarm.toml --block 4"] is None  # swarm.toml made in the scratch folder
    assert "argument --epochs" in str(verdicts["train --data imagefolder:data/x --out runs/x --epochs lots"])
    assert [d.elided for d in found if d.words[0] == "coordinator"] == [True, False]  # `...`: elided on purpose
    assert "--no-such-flag" in str(verdicts["coordinator --no-such-flag"])
    assert verdicts["up --json"] is None


def test_readme_is_a_five_minute_read() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; measurements belong in docs/"
    text = README.read_text()
    # The two commands of a fresh machine, exactly as .ci/run runs them (install, main job; tests).
    install = 'python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e ".[dev]"'
    assert f"\n{install} && .venv/bin/layerswarm up\n" in text
    assert "\nscripts/test\n" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -c constraints.txt -e ".[dev]"' in ci and "\nscripts/test -q -ra --durations=25\n" in ci


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: code marks dropped, lowercase, punctuation gone, spaces to hyphens."""
    text = heading.strip().replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in without_fences(page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_every_relative_link_points_at_a_file_that_exists() -> None:
    broken = []
    checked = 0
    for page in LINKED_PAGES:
        for target in LINK.findall(without_code(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            checked += 1
            path_text, _, anchor = target.partition("#")
            path = (page.parent / path_text).resolve() if path_text else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not path.exists():
                broken.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{where}: no heading #{anchor} in {path.name}")
    assert checked >= 100, f"only {checked} relative links found"
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_no_help_prints_a_doubled_percent(command: str | None) -> None:
    """argparse expands % in help strings only; `95%%` in a description is printed as written (issue 46)."""
    parser = build_parser(command)
    shown = parser.format_help() if command is None else _subparser(parser, command).format_help()  # type: ignore[union-attr]
    assert "%%" not in shown
