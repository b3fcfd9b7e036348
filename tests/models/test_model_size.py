"""Width and depth of a from-scratch model: the ladder of named sizes, the size `--size auto` derives from
the data, explicit --dim/--depth/--heads winning over both, and the choice recorded in the manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerswarm.cli import main
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.config import ViTConfig
from layerswarm.models.vit import ViT
from layerswarm.training.size import AUTO, BY_NAME, DEFAULT, SIZES, auto_size, block_params, choose_size


@pytest.mark.parametrize("size", SIZES, ids=lambda s: s.name)
def test_block_params_count_what_the_blocks_hold(size) -> None:  # type: ignore[no-untyped-def]
    model = ViT(ViTConfig(dim=size.dim, depth=size.depth, heads=size.heads))
    assert size.block_params == sum(p.numel() for p in model.blocks.parameters())
    assert size.dim % size.heads == 0 and size.dim // size.heads == 16


def test_the_ladder_grows_and_base_is_the_long_standing_size() -> None:
    params = [s.block_params for s in SIZES]
    assert params == sorted(params) and len(set(params)) == len(params)
    assert (DEFAULT.name, DEFAULT.dim, DEFAULT.depth, DEFAULT.heads) == ("base", 64, 6, 4)


@pytest.mark.parametrize(
    ("images", "side", "budget"),
    [(100, 32, 600.0), (4000, 32, 600.0), (20000, 32, 600.0), (500, 224, 60.0), (None, None, 600.0)],
)
def test_auto_is_base_everywhere_as_measured_and_records_its_inputs(
    images: int | None, side: int | None, budget: float
) -> None:
    """Measured (docs/results/own-data-size.json): small and large both learned less than base on the
    generated tasks; nothing measured supports another size for any data yet."""
    assert auto_size(images, side, budget)[0] == DEFAULT
    chosen = choose_size(AUTO, train_images=images, image_size=side, time_budget_s=budget)
    assert (chosen["dim"], chosen["depth"], chosen["heads"], chosen["size_chosen"]) == (64, 6, 4, "base")
    assert chosen["size_inputs"] == {"train_images": images, "image_size": side, "time_budget_s": budget}
    assert chosen["size_reason"].startswith("--size auto: base")


def test_the_bare_command_line_gets_auto() -> None:
    from layerswarm.cli import build_parser

    args = build_parser("train").parse_args(["train", "--data", "shapes", "--out", "x"])
    assert (args.size, args.dim, args.depth, args.heads) == (AUTO, None, None, None)


def test_explicit_flags_win_over_the_size_and_say_so() -> None:
    chosen = choose_size("large", dim=32, heads=2, train_images=4000, image_size=32)
    assert (chosen["dim"], chosen["depth"], chosen["heads"]) == (32, BY_NAME["large"].depth, 2)
    assert chosen["size_chosen"] == "large" and chosen["block_params"] == block_params(32, BY_NAME["large"].depth)
    assert chosen["size_reason"] == "--size large; --dim 32, --heads 2 given"
    every = choose_size(AUTO, dim=16, depth=2, heads=2, train_images=100, image_size=32)
    assert (every["dim"], every["depth"], every["heads"]) == (16, 2, 2)
    named = choose_size("small")
    assert (named["dim"], named["depth"], named["heads"]) == (48, 4, 3) and named["size_reason"] == "--size small"


def test_a_dim_the_heads_do_not_divide_names_the_flags() -> None:
    with pytest.raises(ValueError, match=r"--dim 50 is not a multiple of the base size's 4 heads \(give --heads\)"):
        choose_size("base", dim=50)
    with pytest.raises(ValueError, match="--dim 64 is not a multiple of --heads 5"):
        choose_size("base", dim=64, heads=5)
    with pytest.raises(ValueError, match="--size 'huge'"):
        choose_size("huge")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
        (["--dim", "50"], "--dim 50 is not a multiple of the "),
        (["--dim", "0"], "argument --dim: must be at least 1, got 0"),
    ],
)
def test_cli_refuses_a_bad_size_naming_the_flag(
    extra: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--data", "shapes1:32:8", "--out", str(tmp_path / "never"), "--epochs", "1", *extra]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith("layerswarm train: error:") and expected in line, err
    assert not (tmp_path / "never").exists()


def test_the_manifest_records_the_size_and_why_and_the_bench_reads_it(tmp_path: Path) -> None:
    from layerswarm.bench.own_data import render_runs, run_row

    data = tmp_path / "relations-32" / "data"
    assert main(["datasets", "relations", str(data), "--train", "32", "--val", "16"]) == 0
    argv = ["train", "--data", f"imagefolder:{data}", "--out", str(tmp_path / "m"), "--epochs", "1"]
    assert main([*argv, "--size", "small", "--depth", "1", "--no-reference", "--threads", "1", "--workers", "0"]) == 0
    manifest = read_manifest(tmp_path / "m")
    size = manifest.recipe["size"]
    assert (manifest.config.dim, manifest.config.depth, manifest.config.heads) == (48, 1, 3)
    assert size["size"] == "small" and size["size_reason"] == "--size small; --depth 1 given"
    assert size["block_params"] == block_params(48, 1) and size["size_inputs"]["train_images"] == 32
    assert size["size_inputs"]["image_size"] == 32 and size["size_inputs"]["time_budget_s"] == 600.0
    row = run_row(tmp_path / "m")
    assert (row["task"], row["train_images"], row["dim"], row["depth"], row["heads"]) == ("relations", 32, 48, 1, 3)
    assert row["block_params"] == block_params(48, 1) and row["epochs"] == 1
    assert row["test_sequential"] == manifest.metrics["test_sequential"] and "--size small" in row["command"]
    assert "| relations | 32 | --epochs 1 --size small --depth 1 | 48 x 1 (3) | 28,272 |" in render_runs([row])
    (tmp_path / "rel32").symlink_to(data)  # a data folder not named data/: its own name is the task's
    argv = ["train", "--data", f"imagefolder:{tmp_path / 'rel32'}", "--out", str(tmp_path / "n"), "--epochs", "1"]
    assert main([*argv, "--size", "small", "--depth", "1", "--no-reference", "--threads", "1", "--workers", "0"]) == 0
    assert run_row(tmp_path / "n")["task"] == "rel32"
