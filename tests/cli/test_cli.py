"""The command line: settings from defaults, a TOML file, the environment and flags, in that order;
operator mistakes answered with one line naming the flag or file and exit status 2; zoo and samples."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from layerswarm.cli import build_parser, main
from layerswarm.cli.base import UsageError, load_settings, one_line
from layerswarm.cli.up import check_node_count
from layerswarm.coordinator.settings import OPEN_PATHS, CoordinatorSettings
from layerswarm.models.zoo import family_root
from layerswarm.node.settings import NodeSettings
from layerswarm.training.runs import check_out_writable

SHIPPED = "zoo:shapes/layershuffle-0"
EXIT_CONFIDENCE_5 = ("--exit-rule", "confidence", "--exit-threshold", "5")


def settings_of(argv: list[str]) -> object:
    return load_settings(build_parser().parse_args(argv))


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real entry point in a child process: what an operator sees."""
    cmd = [sys.executable, "-m", "layerswarm", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=env)


def test_defaults_come_from_the_settings_class() -> None:
    node = settings_of(["node", "--model-dir", SHIPPED, "--block", "2"])
    assert node == NodeSettings(model_dir=family_root() / "layershuffle-0", block=2)
    coord = settings_of(["coordinator", "--model-dir", SHIPPED])
    assert coord == CoordinatorSettings(model_dir=family_root() / "layershuffle-0")


def test_help_shows_every_default_of_node_and_coordinator() -> None:
    for command, cls in (("node", NodeSettings), ("coordinator", CoordinatorSettings)):
        text = build_parser()._subparsers._group_actions[0].choices[command].format_help()  # type: ignore[union-attr]
        flat = " ".join(text.split())
        assert "default: 127.0.0.1; key host" in flat or "default: 127.0.0.1; key http_host" in flat
        for key in ("grace_s",) if command == "node" else ("hop_timeout_s", "hedge_quantile", "max_upload_bytes"):
            default = cls.model_fields[key].default
            assert f"(default: {default}; key {key})" in flat, key


def test_precedence_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "swarm.toml"
    config.write_text(
        f'[coordinator]\nmodel_dir = "{SHIPPED}"\nhttp_port = 9001\nhop_timeout_s = 3.5\nmin_blocks = 2\n'
        'peers = ["10.0.0.1:50051"]\n[node]\nblock = 4\nport = 50060\n'
    )
    base = ["coordinator", "--config", str(config)]
    from_file = settings_of(base)
    assert (from_file.http_port, from_file.hop_timeout_s, from_file.min_blocks) == (9001, 3.5, 2)  # type: ignore[attr-defined]
    assert from_file.peers == ("10.0.0.1:50051",)  # type: ignore[attr-defined]
    monkeypatch.setenv("LAYERSWARM_COORDINATOR_HTTP_PORT", "9002")
    monkeypatch.setenv("LAYERSWARM_COORDINATOR_HOP_TIMEOUT_S", "4.5")
    from_env = settings_of(base)
    assert (from_env.http_port, from_env.hop_timeout_s, from_env.min_blocks) == (9002, 4.5, 2)  # type: ignore[attr-defined]
    from_flags = settings_of([*base, "--http-port", "9003"])
    assert (from_flags.http_port, from_flags.hop_timeout_s) == (9003, 4.5)  # type: ignore[attr-defined]
    node = settings_of(["node", "--config", str(config), "--model-dir", SHIPPED])
    assert (node.block, node.port) == (4, 50060)  # type: ignore[attr-defined]  # one file, one table per process


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["coordinator", "--model-dir", SHIPPED, "--peer", "notaport"], {}, "--peer (setting peers"),
        (["node", "--model-dir", "zoo:nope", "--block", "0"], {}, "zoo:shapes/baseline, zoo:shapes/layer"),
        (["coordinator", "--model-dir", "zoo:shapes/nope"], {}, "--model-dir (setting model_dir"),
        (["node", "--model-dir", SHIPPED, "--block", "-1"], {}, "--block (setting block"),
        (
            ["node", "--block", "0"],
            {},
            "--model-dir (setting model_dir, env LAYERSWARM_NODE_MODEL_DIR): Field required",
        ),
        (["coordinator", "--model-dir", SHIPPED], {"LAYERSWARM_COORDINATOR_HTTP_PORT": "x"}, "http_port"),
        (["coordinator", "--model-dir", SHIPPED, "--hedge-quantile", "1.5"], {}, "--hedge-quantile"),
        (["train", "--data", "shapes:0:0", "--out", "x"], {}, "argument --data: "),
        (["train", "--data", "shapes:abc", "--out", "x"], {}, "argument --data: "),
        (
            ["train", "--data", "shapes", "--out", "x", "--batch-size", "0"],
            {},
            "argument --batch-size: must be at least 1, got 0",
        ),
        (
            ["train", "--data", "shapes", "--out", "x", "--epochs", "0"],
            {},
            "argument --epochs: must be at least 1, got 0",
        ),
        (["eval", "x", "--json", "r.json", "--orders", "2"], {}, "argument --orders: must be at least 10, got 2"),
        (["samples", "out", "--family", "zoo:nope"], {}, "--family zoo:nope: no such shipped model"),
        (["coordinator", "--model-dir", SHIPPED, "--max-upload-bytes", "0"], {}, "--max-upload-bytes (setting"),
        (["coordinator", "--model-dir", SHIPPED, "--peer-dns", "svc"], {}, "'svc' is not NAME:PORT"),
        (["coordinator", "--model-dir", SHIPPED, "--hedge-min-ms", "-1"], {}, "--hedge-min-ms (setting"),
        (["coordinator", "--model-dir", SHIPPED], {"LAYERSWARM_COORDINATOR_EJECT_AFTER": "0"}, "eject_after"),
        (["coordinator", "--model-dir", SHIPPED], {"LAYERSWARM_COORDINATOR_EXIT_RULE": "often"}, "'often' is not one"),
        (
            ["coordinator", "--model-dir", SHIPPED, "--no-mdns", "--http-port", "0", *EXIT_CONFIDENCE_5],
            {},
            "--exit-threshold 5: confidence threshold must be in (0, 1]",
        ),
        (["node", "--model-dir", SHIPPED, "--block", "0", "--device", "gpu"], {}, "'gpu' is not one of auto, cpu"),
        (["node", "--model-dir", SHIPPED, "--block", "0", "--metrics-port", "70000"], {}, "--metrics-port (setting"),
        (["node", "--model-dir", SHIPPED, "--block", "0", "--token-file", "/nonexistent"], {}, "--token-file: /nonex"),
        (["samples", __file__], {}, "argument dir: " + __file__ + " is a file, not a folder"),
        (["eval", "/nonexistent"], {}, "/nonexistent: no manifest.json"),
        (["train", "--data", "shapes", "--out", "x", "--reference-seconds", "-1"], {}, "--reference-seconds: must be"),
        (["train", "--data", "shapes", "--out", "x", "--drop-path", "1"], {}, "--drop-path: must be at least 0 and"),
        (["up", "--nodes", "4", "--kill", "4", "--network", "loopback"], {}, "--kill 4 must leave a node alive"),
        (["up", "--nodes", "1", "--network", "loopback"], {}, "--nodes 1: at least 8 needed, one per block index"),
        (["up", "--family-dir", "/nonexistent", "--network", "loopback"], {}, "--family-dir /nonexistent: no such"),
        (["up", "--family", "nope", "--network", "loopback"], {}, "--family nope: no such folder (a shipped family's"),
        (["samples", "out", "--family", "nope"], {}, "--family nope: no such folder"),
        (["samples", "out", "--family", "zoo:text"], {}, "--family zoo:text: a text model; samples are images"),
        (["family", "--base", "b", "--out", "x", "--lr", "0"], {}, "argument --lr: must be a finite number above 0"),
        (["eval", "x", "--margin", "101"], {}, "argument --margin: must be between 0 and 100 points, got 101"),
        (["probe", "http", "http://127.0.0.1:9/", "--timeout", "-1"], {}, "argument --timeout: must be a finite"),
    ],
)
def test_operator_mistakes_get_one_line_and_status_2(
    argv: list[str],
    env: dict[str, str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"layerswarm {argv[0]}: error:")


def test_an_image_folder_in_no_known_layout_lists_the_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "only").mkdir()
    assert main(["train", "--data", f"imagefolder:{tmp_path}", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"layerswarm train: error: imagefolder: {tmp_path} needs at least two class"), err
    assert "accepted layouts: ROOT/train/<class>/<image> with ROOT/val/" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing written


def test_train_out_that_is_a_file_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for out, why in ((afile, ""), (afile / "model", f" ({afile} is)")):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--data", "shapes", "--out", str(out)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --out: {out} is a file, not a folder{why}" in err and "Traceback" not in err, err


def test_train_and_family_refuse_to_replace_a_model_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second command with the same --out replaced a trained model without a word; an unfinished
    run's state was started over. Both are refused before any data is read, naming the way out."""
    model = tmp_path / "model"
    shutil.copytree(family_root("shapes") / "layershuffle-0", model)
    before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    assert main(["train", "--data", "shapes", "--out", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"--out {model} already holds a trained model" in err and "--overwrite" in err, err
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before

    unfinished = tmp_path / "unfinished"
    (unfinished / ".train_state").mkdir(parents=True)
    assert main(["train", "--data", "shapes", "--out", str(unfinished)]) == 2
    err = capsys.readouterr().err
    assert "unfinished run's state: --resume to continue it, or --overwrite" in err, err
    check_out_writable(unfinished, resume=True)  # what --resume is for
    check_out_writable(model, overwrite=True)

    # family: refused before member 0 trains when member 1 already holds a model
    family = tmp_path / "family"
    shutil.copytree(model, family / "member-1")
    assert main(["family", "--base", str(model), "--out", str(family)]) == 2
    err = capsys.readouterr().err
    assert f"--out {family / 'member-1'} already holds a trained model" in err, err
    assert not (family / "member-0").exists()


def _class_folders(root: Path) -> None:
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(root / name / f"{i}.png")


@pytest.mark.parametrize(("broken", "reason"), [("empty", "not an image Pillow can read"), ("truncated", "truncated")])
def test_an_unreadable_image_is_one_line_naming_the_file_with_workers_too(
    broken: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file is refused when the folder is scanned; a truncated one (sound header) when a
    DataLoader worker decodes it, whose wrapped traceback must not reach the operator."""
    _class_folders(tmp_path / "data")
    path = tmp_path / "data" / "b" / "broken.png"
    if broken == "truncated":
        noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(noise).save(path)
        path.write_bytes(path.read_bytes()[:1000])
    else:
        path.write_bytes(b"")
    argv = ["train", "--data", f"imagefolder:{tmp_path / 'data'}", "--out", str(tmp_path / "out"), "--workers", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"layerswarm train: error: imagefolder: {path}: ") and reason in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "DataLoader" not in err


class _FailingDataset(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        try:
            raise KeyError(index)
        except KeyError as exc:
            raise OSError("what went wrong\nand more on the next line") from exc


def test_a_dataloader_worker_error_becomes_its_first_line() -> None:
    loader = torch.utils.data.DataLoader(_FailingDataset(), batch_size=None, num_workers=1)
    with pytest.raises(OSError) as info:
        next(iter(loader))
    assert "in DataLoader worker process 0" in str(info.value) and "Traceback" in str(info.value)
    assert one_line(str(info.value)) == "what went wrong"
    assert one_line("imagefolder: x.png: image file is truncated") == "imagefolder: x.png: image file is truncated"


def test_a_closed_stdout_ends_the_command_quietly() -> None:
    """`layerswarm zoo --json | head -2`: the reader goes away; no error message, the status of SIGPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        cmd = [sys.executable, "-m", "layerswarm", "zoo", "--json"]
        result = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, "")


def test_family_flags_mean_one_thing_across_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """--family: a shipped family's name or a folder, in `up` and `samples`; --family-dir: another member's
    model directory, in `coordinator` only. `up`'s old --family-dir (a family folder) still runs, warned."""
    from layerswarm.models.zoo import resolve_family

    assert resolve_family("shapes") == resolve_family("zoo:shapes") == family_root()
    assert resolve_family("text") == family_root("text") and resolve_family("runs/x") == Path("runs/x")
    assert "--family-dir" not in _help("up") and "--family-dir" not in _help("samples")
    assert "--family-dir FAMILY_DIR another member's model directory" in _help("coordinator")
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["up", "--family-dir", "/nonexistent", "--network", "loopback"]))
    assert exit_info.value.code == 2
    assert "--family-dir is deprecated in up: use --family DIR" in capsys.readouterr().err


def test_up_accepts_one_node_per_block_index_and_no_fewer() -> None:
    check_node_count(8, family_root(), "--family")
    check_node_count(None, family_root(), "--family")
    with pytest.raises(UsageError, match="--nodes 7: at least 8 needed"):
        check_node_count(7, family_root(), "--family")


def test_log_flags_work_before_and_after_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAYERSWARM_LOG", raising=False)
    monkeypatch.delenv("LAYERSWARM_LOG_FORMAT", raising=False)
    plain = build_parser().parse_args(["zoo"])
    assert (plain.log_level, plain.log_format) == ("WARNING", "text")
    model = ["--model-dir", SHIPPED]
    after = build_parser().parse_args(["coordinator", *model, "--log-format", "json", "--log-level", "INFO"])
    before = build_parser().parse_args(["--log-format", "json", "--log-level", "INFO", "coordinator", *model])
    assert (after.log_level, after.log_format) == (before.log_level, before.log_format) == ("INFO", "json")
    assert build_parser().parse_args(["--log-level", "ERROR", "zoo", "--log-level", "DEBUG"]).log_level == "DEBUG"
    monkeypatch.setenv("LAYERSWARM_LOG", "INFO")
    assert build_parser().parse_args(["zoo", "--log-format", "json"]).log_level == "INFO"


def _help(command: str) -> str:
    parser = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return " ".join(parser.format_help().split())


@pytest.mark.parametrize(
    ("command", "groups"),
    [
        (
            "coordinator",
            [
                "model and family",
                "discovery",
                "routing",
                "adaptive compute",
                "verification",
                "generation",
                "HTTP",
                "security",
            ],
        ),
        ("node", ["block", "serving", "discovery", "security"]),
    ],
)
def test_long_helps_are_grouped(command: str, groups: list[str]) -> None:
    """coordinator --help was 45 flags in one list (issue 46): every flag of a setting now sits in a titled
    group; only --help, --config and the log flags stay under options."""
    parser = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    titled = {g.title: [a.option_strings[0] for a in g._group_actions] for g in parser._action_groups}
    assert [t for t in titled if t not in ("positional arguments", "options")] == groups
    assert sorted(titled["options"]) == ["--config", "--log-format", "--log-level", "-h"]
    assert all(len(titled[g]) >= 2 for g in groups)
    if command == "coordinator":
        assert {"--min-blocks", "--exit-rule"} <= set(titled["adaptive compute"])
        assert {"--api-key-file", "--http-port"} <= set(titled["HTTP"])
        assert {"--token-file", "--tls-ca"} <= set(titled["security"])


def test_help_states_each_default_once_and_truly() -> None:
    train = _help("train")
    assert "--no-reference skip the reference: by default a small CNN" in train
    assert "(default: True)" not in train and "(default: False)" not in train  # on/off flags say it in words
    assert "--margin MARGIN points of accuracy an exit may lose vs the full path (default: 1.0) --" in _help("eval")
    api_keys = _help("coordinator").split("--api-key-file API_KEY_FILE ", 1)[1].split(" --", 1)[0]
    assert f"except {', '.join(OPEN_PATHS)} (default: none" in api_keys  # what the front door lets through
    assert "/redoc" in api_keys and "swarm page" in api_keys


def test_the_fault_wrapper_lists_every_fault_flag_the_docs_name(capsys: pytest.CaptureFixture[str]) -> None:
    from layerswarm.harness import faults

    with pytest.raises(SystemExit) as exit_info:
        faults.main(["--help"])
    assert exit_info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    documented = {flag for page in pages for flag in re.findall(r"--fault-[a-z-]+[a-z]", page.read_text())}
    assert "--fault-delay-ms" in documented
    for flag in documented:
        assert f"{flag} " in shown, flag
    assert "--model-dir MODEL_DIR" in shown and "--block BLOCK" in shown  # the node's flags it passes on


def test_bad_config_files_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unknown, broken = tmp_path / "unknown.toml", tmp_path / "broken.toml"
    unknown.write_text('[node]\nmodel_dir = "x"\nblok = 1\n')
    broken.write_text("[node\n")
    for path, expected in ((unknown, "unknown setting 'blok' in [node]"), (broken, "not valid TOML")):
        assert main(["node", "--config", str(path)]) == 2
        assert f"layerswarm node: error: --config {path}: {expected}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["node", "coordinator"])
def test_port_in_use_is_one_line_not_a_traceback(command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        flag = "--port" if command == "node" else "--http-port"
        extra = ["--block", "0", "--no-advertise"] if command == "node" else ["--no-mdns"]
        result = run_cli(command, "--model-dir", SHIPPED, flag, port, *extra)
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip()
        == f"layerswarm {command}: error: {flag} {port}: cannot listen on 127.0.0.1:{port} (Address already in use)"
    )


def test_zoo_lists_the_shipped_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["zoo"]) == 0
    out = capsys.readouterr().out
    assert "zoo:shapes/layershuffle-0" in out and "zoo:shapes/baseline" in out and "layershuffle" in out
    row = next(line for line in out.splitlines() if line.startswith("zoo:shapes/layershuffle-0 "))
    assert float(row.split()[-1]) > 0.9  # the arbitrary-order accuracy recorded when it was trained
    assert row.split()[-2:] == ["0.9960", "0.9930"]  # the manifest's, at the docs' four decimals
    table = out.split("\n\n")[0].splitlines()
    assert len({len(line) for line in table}) == 1  # aligned: zoo:shapes-exit/... once pushed its row right
    assert "one draw of random orders; `layerswarm eval` averages 10 orders" in out


def test_samples_writes_labelled_images_of_the_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["samples", str(tmp_path), "--count", "3"]) == 0
    written = sorted(tmp_path.iterdir())
    assert [p.name.split("-", 1)[0] for p in written] == ["000", "001", "002"]
    classes = {"disc", "square", "triangle", "plus"}
    for path in written:
        assert set(path.stem.split("-", 1)[1].split("+")) <= classes  # the label names the shapes shown
        with Image.open(path) as image:
            assert image.size == (32, 32) and image.mode == "RGB"
    assert capsys.readouterr().out.split() == [str(p) for p in written]


def test_every_command_is_a_module_with_its_own_entry_point() -> None:
    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    for name, parser in sub.choices.items():  # type: ignore[union-attr]
        func = parser.get_default("func")
        assert func is not None and func.__module__ == f"layerswarm.cli.{name.replace('-', '_')}", name


def test_the_documented_config_file_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    monkeypatch.chdir(tmp_path)  # the token file it names, relative to where the process starts
    (tmp_path / "swarm.token").write_text("t" * 64)
    config = tmp_path / "swarm.toml"
    config.write_text(doc.split("```toml\n", 1)[1].split("```", 1)[0])
    node = settings_of(["node", "--config", str(config), "--block", "3"])
    assert (node.port, node.grace_s, node.block) == (50051, 10.0, 3)  # type: ignore[attr-defined]
    coord = settings_of(["coordinator", "--config", str(config)])
    assert coord.peers == ("10.0.0.7:50051", "10.0.0.8:50051") and not coord.mdns  # type: ignore[attr-defined]
    assert coord.family_dirs == (family_root() / "layershuffle-1",)  # type: ignore[attr-defined]


def test_log_format_json_writes_one_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import logging

    from layerswarm.cli import logs

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        root.handlers[:] = []  # as in a fresh process (pytest's own capture handlers would stay otherwise)
        logs.configure("INFO", "json")
        logging.getLogger("layerswarm.test").info("node %s ejected", "10.0.0.1:50051")
    finally:
        root.handlers[:], root.level = saved
    record = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert record["message"] == "node 10.0.0.1:50051 ejected" and record["level"] == "INFO"
    assert record["logger"] == "layerswarm.test" and record["time"]


@pytest.mark.parametrize(("status", "exit_status"), [(200, 0), (204, 0), (503, 1), (404, 1)])
def test_probe_http_exit_status_follows_the_answer(status: int, exit_status: int) -> None:
    """`layerswarm probe http URL` (the coordinator's container HEALTHCHECK) against a real HTTP server."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/readyz"
    try:
        result = run_cli("probe", "http", url)
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == exit_status and result.stdout.strip() == f"{url}: HTTP {status}"


def test_probe_http_with_nothing_listening_is_unhealthy() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    result = run_cli("probe", "http", f"http://127.0.0.1:{port}/readyz", "--timeout", "1")
    assert result.returncode == 1 and result.stdout.startswith(f"http://127.0.0.1:{port}/readyz: ")


@pytest.mark.parametrize("command", ["node", "coordinator"])
def test_a_host_this_machine_cannot_listen_on_names_the_host_flag(command: str) -> None:
    """Before, a node died with a gRPC traceback (RuntimeError: Failed to bind) and a coordinator blamed
    --http-port. 192.0.2.1 (TEST-NET-1) is no address of this machine (a literal: no name lookup)."""
    host = "192.0.2.1"
    flag = "--host" if command == "node" else "--http-host"
    extra = ["--block", "0", "--no-advertise"] if command == "node" else ["--no-mdns"]
    result = run_cli(command, "--model-dir", SHIPPED, flag, host, *extra, "--insecure")  # past the token check
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"layerswarm {command}: error: {flag} {host}: "), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_bench_only_cuda_without_a_gpu_is_one_line_naming_the_flag() -> None:
    result = run_cli("bench", "--only", "cuda")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "layerswarm bench: error: --only cuda: torch sees no CUDA GPU on this machine (the other suites run on the CPU)"
    )
