"""The paper's setup at its real size, measured: a ViT-B/16-shaped checkpoint (random weights, written in
Hugging Face's layout) imported, fine-tuned with LayerShuffle from an image folder at 224 x 224,
evaluated, and served by a 12-node swarm over HTTP (a 224 image, and a 640 x 480 photo with resize).

    python -m layerswarm.bench.realsize --json realsize.json [--steps 3] [--batch-size 8] [--serve]

Every step goes through the code a user runs: import_hf_vit, the image-folder loader (streamed from
disk, decoding workers), the Trainer (lr 1e-4, Adam 0.9/0.999/1e-6), evaluate_loss, node and
coordinator processes. The figures are seconds per step and images per second on this machine;
weights are random, so accuracy means nothing here.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from layerswarm.harness.procs import stop_all
from layerswarm.models.checkpoint import Lineage, save_model
from layerswarm.models.config import ViTConfig
from layerswarm.models.vit import ViT
from layerswarm.training.data.datasets import load_dataset
from layerswarm.training.hf_import import import_hf_vit
from layerswarm.training.objective import evaluate_loss
from layerswarm.training.recipe import TrainRecipe
from layerswarm.training.train import Trainer

from . import emit_report
from .fixtures import VITB, coordinator_process, median_ms, nodes
from .machine import environment

log = logging.getLogger(__name__)


def write_random_hf_vit(path: Path, num_labels: int = 1000) -> Path:
    """config.json + model.safetensors in google/vit-base-patch16-224's key layout, random weights."""
    torch.manual_seed(0)
    cfg = ViTConfig(**{**VITB, "num_classes": num_labels}, pos_embed_init_std=0.02)
    ours = ViT(cfg).state_dict()
    hf: dict[str, torch.Tensor] = {
        "vit.embeddings.cls_token": ours["stem.cls_token"],
        "vit.embeddings.position_embeddings": ours["stem.pos_embed"],
        "vit.embeddings.patch_embeddings.projection.weight": ours["stem.patch_embed.weight"],
        "vit.embeddings.patch_embeddings.projection.bias": ours["stem.patch_embed.bias"],
        "vit.layernorm.weight": ours["head.norm.weight"],
        "vit.layernorm.bias": ours["head.norm.bias"],
        "classifier.weight": ours["head.classifier.weight"],
        "classifier.bias": ours["head.classifier.bias"],
    }
    for i in range(cfg.depth):
        src, dst = f"blocks.{i}.", f"vit.encoder.layer.{i}."
        for part in ("weight", "bias"):
            q, k, v = ours[src + f"attn.qkv.{part}"].chunk(3)
            for name, tensor in (("query", q), ("key", k), ("value", v)):
                hf[dst + f"attention.attention.{name}.{part}"] = tensor
            hf[dst + f"attention.output.dense.{part}"] = ours[src + f"attn.proj.{part}"]
            hf[dst + f"intermediate.dense.{part}"] = ours[src + f"mlp.fc1.{part}"]
            hf[dst + f"output.dense.{part}"] = ours[src + f"mlp.fc2.{part}"]
            hf[dst + f"layernorm_before.{part}"] = ours[src + f"norm1.{part}"]
            hf[dst + f"layernorm_after.{part}"] = ours[src + f"norm2.{part}"]
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["ViTForImageClassification"],
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.heads,
        "intermediate_size": int(cfg.dim * cfg.mlp_ratio),
        "hidden_act": "gelu",
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "num_channels": 3,
        "layer_norm_eps": 1e-12,
        "id2label": {str(i): f"class{i}" for i in range(num_labels)},
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_photo_folder(root: Path, train_per_class: int, test_per_class: int, classes: int = 2) -> Path:
    """JPEG photos of 640 x 480 (a camera's aspect, not the model's): decoding and resizing are measured too."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("val", test_per_class)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)
    return root


def fine_tune(root: Path, steps: int, batch_size: int, device: str, workers: int) -> tuple[dict[str, Any], ViT]:
    """`steps` LayerShuffle steps of the paper's recipe, from the checkpoint, on streamed 224 x 224 data."""
    # n images leave n - int(0.1 n) to train on: pick n so that is exactly steps x batch_size.
    n = next(n for n in range(steps * batch_size, 2 * steps * batch_size + 2) if n - int(n * 0.1) == steps * batch_size)
    folder = write_photo_folder(root / "photos", train_per_class=-(-n // 2), test_per_class=16)
    data = load_dataset(f"imagefolder:{folder}", image_size=224, workers=workers, memory_limit_bytes=0)
    model, _ = import_hf_vit(write_random_hf_vit(root / "hf"), num_classes=2, class_names=data.class_names)
    recipe = TrainRecipe(variant="layershuffle", epochs=1, batch_size=batch_size, lr=1e-4, warmup_steps=1)
    trainer = Trainer(model, data, recipe, torch.device(device), root / "state", workers=workers)
    started = time.perf_counter()
    record = trainer.fit()
    return {
        "train_images": len(trainer.train_idx),
        "batch_size": batch_size,
        "steps": trainer.steps_per_epoch,
        "seconds_per_step": round(record["step_s"], 3),
        "cpu_seconds_per_step": round(record["step_cpu_s"], 3),
        "torch_threads": torch.get_num_threads(),
        "steps_per_second": round(1 / record["step_s"], 4),
        "images_per_second": round(batch_size / record["step_s"], 3),
        "validation_seconds": round(time.perf_counter() - started - record["seconds"], 2),
        "peak_rss_mb": record["peak_rss_mb"],
        "peak_cuda_mb": record.get("peak_cuda_mb"),
        "note": "mean over every step, the first (allocator warm-up) included; decoding in workers",
    }, trainer.model


def eval_speed(model: ViT, root: Path, batch_size: int, workers: int, device: str) -> dict[str, Any]:
    """Sequential-order inference over the streamed test folder, decoding included, and on decoded tensors."""
    data = load_dataset(f"imagefolder:{root / 'photos'}", image_size=224, workers=workers, memory_limit_bytes=0)
    model = model.to(device).eval()
    started = time.perf_counter()
    evaluate_loss(model, data.test_x, data.test_y, batch_size=batch_size, workers=workers)
    streamed = time.perf_counter() - started
    decoded = data.test_x[torch.arange(len(data.test_y))]
    started, cpu_started = time.perf_counter(), time.process_time()
    evaluate_loss(model, decoded, data.test_y, batch_size=batch_size)
    in_memory, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    n = len(data.test_y)
    return {
        "images": n,
        "batch_size": batch_size,
        "images_per_second_streamed": round(n / streamed, 3),
        "images_per_second_decoded": round(n / in_memory, 3),
        "cpu_seconds_per_image_decoded": round(cpu / n, 3),
    }


def serve(model: ViT, root: Path, requests: int) -> dict[str, Any]:
    """12 node processes and a coordinator serving the fine-tuned model; HTTP at 224 and with resize."""
    model_dir = root / "served"
    save_model(model.cpu(), model_dir, Lineage(root="hf-bench", source="huggingface"))
    at_size, photo = _png(224, 224), _jpeg(640, 480)
    out: dict[str, Any] = {"nodes": model.cfg.depth}
    with nodes([(model_dir, b) for b in range(model.cfg.depth)]) as procs:
        coord = coordinator_process(model_dir, procs, "--policy", "shuffle", "--hop-timeout", "60")
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{coord.ready['port']}", timeout=300) as client:
                cases = {"png_224": (at_size, {}), "jpeg_640x480_resize": (photo, {"resize": "true"})}
                for name, (image, form) in cases.items():
                    out[name] = _classify_many(client, image, form, requests)
                wrong = client.post("/v1/classify", files={"file": ("x.jpg", photo, "image/jpeg")})
                out["jpeg_640x480_without_resize"] = {"status": wrong.status_code, "error": wrong.json().get("error")}
        finally:
            stop_all([coord])
    return out


def _classify_many(client: httpx.Client, image: bytes, form: dict[str, str], requests: int) -> dict[str, Any]:
    latencies, depths, statuses = [], set(), set()
    for i in range(requests + 1):  # the first warms channels up
        started = time.perf_counter()
        reply = client.post("/v1/classify", files={"file": ("x", image, "application/octet-stream")}, data=form)
        elapsed = time.perf_counter() - started
        statuses.add(reply.status_code)
        if reply.status_code == 200:
            depths.add(reply.json()["depth"])
        if i:
            latencies.append(elapsed)
    return {"statuses": sorted(statuses), "depths": sorted(depths), "latency_p50_ms": median_ms(latencies)}


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(2).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def run(steps: int, batch_size: int, device: str, workers: int, serve_requests: int) -> dict[str, Any]:
    report: dict[str, Any] = {"environment": environment(), "device": device, "model": "ViT-B/16 shape, 224 x 224"}
    with tempfile.TemporaryDirectory(prefix="layerswarm-realsize-") as tmp:
        root = Path(tmp)
        report["fine_tune"], model = fine_tune(root, steps, batch_size, device, workers)
        report["eval"] = eval_speed(model, root, batch_size, workers, device)
        if serve_requests:
            report["serve"] = serve(model, root, serve_requests)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerswarm.bench.realsize", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True, help="write the report here")
    p.add_argument("--steps", type=int, default=3, help="fine-tuning steps measured (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default: %(default)s)")
    p.add_argument("--workers", type=int, default=1, help="decoding processes (default: %(default)s)")
    p.add_argument("--serve", type=int, default=0, metavar="N", help="also serve: N HTTP requests per case")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return emit_report(run(args.steps, args.batch_size, args.device, args.workers, args.serve), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
