"""A model at a size other than 32 x 32, end to end: a Hugging Face ViT at 64 x 64 (patch 16: 17 tokens),
fine-tuned from an image folder of 80 x 60 photos, made a family, evaluated, served by real node
processes and a real coordinator. Every step would fail, or answer differently, if any of them
decoded at another size: the stem refuses 5 tokens where it expects 17, eval compares shapes, and
the HTTP answer must equal the local model on the same resized pixels.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from layerswarm.cli import main
from layerswarm.coordinator import ClassifyOptions, Policy
from layerswarm.harness.procs import Proc, stop_all
from layerswarm.models.checkpoint import load_model, read_manifest
from layerswarm.models.images import decode_image
from layerswarm.training.data.datasets import labelled_samples
from layerswarm.training.hf_import import import_hf_vit

from ..swarm import coordinator, coordinator_process, start_nodes

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
pytestmark = pytest.mark.slow

SIZE = 64
PHOTO = (80, 60)  # width, height: neither the model's size nor square
CLASSES = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}
# Not HF's 0.5 / 0.5 defaults: the import must read them from preprocessor_config.json.
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: a second torch thread only waits for the first on a busy machine (measured: 10x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_checkpoint(path: Path) -> transformers.ViTForImageClassification:
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=SIZE,
        patch_size=16,
        num_labels=5,
    )
    model = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    processor().save_pretrained(path)
    return model


def processor() -> transformers.ViTImageProcessor:
    return transformers.ViTImageProcessor(size={"height": SIZE, "width": SIZE}, image_mean=MEAN, image_std=STD)


def photo(colour: tuple[int, int, int], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + rng.integers(-40, 40, size=(PHOTO[1], PHOTO[0], 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_folder(root: Path) -> None:
    for split, count in (("train", 12), ("val", 3)):
        for c, (name, colour) in enumerate(CLASSES.items()):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                (root / split / name / f"{i}.png").write_bytes(photo(colour, seed=100 * c + i + (split == "val")))


def test_import_normalises_as_hf_processor_does(tmp_path: Path) -> None:
    """The same photo through HF (processor + model) and through us (decode at size + imported model)."""
    reference = hf_checkpoint(tmp_path)
    model, _ = import_hf_vit(tmp_path)
    assert model.cfg.image_mean == pytest.approx(MEAN) and model.cfg.image_std == pytest.approx(STD)
    data = photo((120, 60, 200), seed=1)
    with Image.open(io.BytesIO(data)) as img:
        pixel_values = processor()(images=img.convert("RGB"), return_tensors="pt")["pixel_values"]
    ours = torch.from_numpy(decode_image(data, SIZE))[None]
    normalised = (ours - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.allclose(normalised, pixel_values, atol=1e-5), (normalised - pixel_values).abs().max()
    with torch.no_grad():
        assert torch.allclose(model(ours), reference(pixel_values=pixel_values).logits, atol=1e-4)


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hf:CKPT -> fine-tuned base (streamed from disk, 2 decoding workers) -> a family of two."""
    root = tmp_path_factory.mktemp("realsize")
    hf_checkpoint(root / "hf")
    image_folder(root / "photos")
    data = f"imagefolder:{root / 'photos'}"
    recipe = ["--epochs", "1", "--batch-size", "8", "--lr", "1e-4", "--warmup-steps", "1"]
    streamed = ["--workers", "2", "--data-memory-mb", "0"]
    assert (
        main(["train", "--data", data, "--init", f"hf:{root / 'hf'}", *recipe, *streamed, "--out", str(root / "base")])
        == 0
    )
    assert main(["family", "--base", str(root / "base"), "--members", "2", "--epochs", "1", "--batch-size", "8",
                 "--out", str(root / "family")]) == 0  # fmt: skip
    return root


def test_fine_tune_family_and_eval_at_64(family: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = read_manifest(family / "base")
    assert base.config.image_size == SIZE and base.config.num_classes == 3
    assert base.config.image_mean == pytest.approx(MEAN)  # HF's normalisation travels with the model
    assert base.dataset["image_shape"] == [3, SIZE, SIZE] and base.dataset["streamed"] is True
    assert base.lineage.source == "huggingface"
    members = [family / "family" / f"member-{i}" for i in range(2)]
    assert {read_manifest(m).family_id for m in members} == {base.family_id}
    report_path = family / "report.json"
    assert main(["eval", *map(str, members), "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["dataset"]["image_shape"] == [3, SIZE, SIZE] and report["chance"] == pytest.approx(1 / 3)
    assert len(report["groups"]) == 1 and "| member-0 |" in capsys.readouterr().out


@pytest.fixture(scope="module")
def served(family: Path) -> Iterator[tuple[Path, list[Proc], httpx.Client]]:
    member = family / "family" / "member-0"
    nodes = start_nodes([(member, b) for b in range(3)])
    # These tests check the path and the numbers, not timing: on a loaded machine a slow hop must not
    # become a substitution or a skip (a 2 s hop timeout did, at load average 12, failing a full suite run).
    slow_ok = ("--hop-timeout", "30", "--request-timeout", "120")
    coord = coordinator_process(member, nodes, "--wire-dtype", "fp32", "--policy", "sequential", *slow_ok)
    client = httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=150)
    try:
        yield member, nodes, client
    finally:
        client.close()
        stop_all([coord, *nodes])


def test_swarm_logits_equal_the_local_model(served: tuple[Path, list[Proc], httpx.Client]) -> None:
    member, nodes, _ = served
    model, _ = load_model(member)
    images = torch.stack([torch.from_numpy(decode_image(photo(c, seed=7), SIZE)) for c in CLASSES.values()])

    async def through_swarm() -> torch.Tensor:
        coord = coordinator(member, nodes)
        await coord.start()
        try:
            result = await coord.router.classify(images, ClassifyOptions(policy=Policy.SEQUENTIAL, seed=0))
            assert [h.block for h in result.path.hops] == [0, 1, 2]
            return result.probs
        finally:
            await coord.stop()

    with torch.no_grad():
        local = model(images).log_softmax(-1)
    swarm = asyncio.run(through_swarm()).log()  # log-probabilities: the logits up to a per-image constant
    assert torch.allclose(swarm, local, atol=1e-5), (swarm - local).abs().max()


def test_http_classifies_at_the_model_size_and_resizes(served: tuple[Path, list[Proc], httpx.Client]) -> None:
    member, _, client = served
    model, _ = load_model(member)
    data = photo(CLASSES["green"], seed=3)  # 80 x 60
    refused = client.post("/v1/classify", files={"file": ("a.png", data, "image/png")})
    assert refused.status_code == 422 and "the model takes 64x64" in refused.json()["detail"], refused.text
    resized = client.post("/v1/classify", files={"file": ("a.png", data, "image/png")}, data={"resize": "true"})
    at_size = io.BytesIO()
    Image.open(io.BytesIO(data)).resize((SIZE, SIZE), Image.Resampling.BILINEAR).save(at_size, format="PNG")
    exact = client.post("/v1/classify", files={"file": ("b.png", at_size.getvalue(), "image/png")})
    for reply in (resized, exact):
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["depth"] == 3 and [h["block"] for h in body["trace"]["hops"]] == [0, 1, 2]
    with torch.no_grad():
        local = model(torch.from_numpy(decode_image(data, SIZE))[None]).softmax(-1)[0]
    served_probs = {label["label"]: label["probability"] for label in resized.json()["labels"]}
    for name, p in served_probs.items():
        assert p == pytest.approx(float(local[model.cfg.class_names.index(name)]), abs=1e-5)
    assert resized.json()["labels"] == exact.json()["labels"]  # resizing here or there: the same pixels


def test_samples_come_at_the_model_size(served: tuple[Path, list[Proc], httpx.Client]) -> None:
    """Labelled samples for clients are PNGs at 64 x 64, so the coordinator takes them without resize."""
    member, _, client = served
    manifest = read_manifest(member)
    samples = labelled_samples(manifest.dataset, manifest.config.image_size, count=3)
    assert len(samples) == 3 and {label for _, label in samples} <= set(CLASSES)
    for image, _ in samples:
        assert Image.open(io.BytesIO(image)).size == (SIZE, SIZE)
        reply = client.post("/v1/classify", files={"file": ("s.png", image, "image/png")})
        assert reply.status_code == 200, reply.text
