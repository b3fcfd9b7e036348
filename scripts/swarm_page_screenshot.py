"""Screenshot the swarm page of a real local swarm (the README's picture: docs/img/swarm-page.png).

    .venv/bin/python scripts/swarm_page_screenshot.py [--out docs/img/swarm-page.png]

Starts the shipped family's nodes and a coordinator as `layerswarm up --network loopback` does,
sends labelled sample images through layerswarm.client (single images, a batch, some with early
exit), SIGKILLs a few nodes, sends more, then photographs `/` in headless Chromium (loopback only).
Needs chromium and chromium-driver (apt-get install chromium chromium-driver).
"""

from __future__ import annotations

import argparse
import io
import random
import signal
import sys
import time
from pathlib import Path

from PIL import Image, ImageChops

from layerswarm.cli.swarm_demo import UpOptions, start_swarm
from layerswarm.client import SwarmClient, SwarmError
from layerswarm.harness.browser import headless_chromium
from layerswarm.harness.procs import stop_all
from layerswarm.harness.samples import png_bytes
from layerswarm.harness.swarm import wait_for_swarm
from layerswarm.models.checkpoint import read_manifest
from layerswarm.training.data.datasets import load_dataset


def send(swarm: SwarmClient, samples: list[tuple[bytes, str]], rng: random.Random) -> None:
    for i, (image, label) in enumerate(samples):
        try:
            if i % 5 == 4:
                swarm.classify(image, label=label, exit_confidence=0.9, min_blocks=4, seed=rng.randrange(2**31))
            else:
                swarm.classify(image, label=label, seed=rng.randrange(2**31))
        except SwarmError as exc:
            print(f"request failed: {exc}", file=sys.stderr)


def trimmed(image: Image.Image, margin: int = 16) -> Image.Image:
    """Cut the empty page background below the content."""
    background = Image.new("RGB", image.size, image.getpixel((image.width - 1, image.height - 1)))
    box = ImageChops.difference(image, background).getbbox()
    return image if box is None else image.crop((0, 0, image.width, min(image.height, box[3] + margin)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/swarm-page.png"))
    parser.add_argument("--kill", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    nodes, coordinator, members = start_swarm(UpOptions(mdns=False, timeout_s=150))  # 16 processes on 2 cores
    try:
        manifest = read_manifest(members[0])
        data = load_dataset(manifest.dataset["spec"], seed=int(manifest.dataset.get("data_seed", 0)))
        picks = rng.sample(range(len(data.test_y)), 46)
        samples = [(png_bytes(data.test_x[i].numpy()), data.class_names[int(data.test_y[i])]) for i in picks]
        base = f"http://127.0.0.1:{coordinator.ready['port']}"
        with SwarmClient(base) as swarm:
            wait_for_swarm(swarm._http, len(nodes), 60)
            send(swarm, samples[:30], rng)
            swarm.classify_batch([s[0] for s in samples[30:38]], labels=[s[1] for s in samples[30:38]])
            for proc in rng.sample(nodes, args.kill):
                proc.signal(signal.SIGKILL)
            send(swarm, samples[38:46], rng)  # before the ejections: substituted and skipped hops
            time.sleep(2.5)  # health checks eject the dead nodes; the page shows why
        browser = headless_chromium(1280, 1700)  # tall enough for the routes under the nodes
        try:
            browser.get(base + "/")
            time.sleep(2.5)  # two events: the page is live and filled
            png = browser.get_screenshot_as_png()
        finally:
            browser.quit()
    finally:
        stop_all([coordinator, *nodes])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # A palette PNG: the page is flat colours, so 256 of them keep it sharp at a fraction of the size.
    trimmed(Image.open(io.BytesIO(png)).convert("RGB")).quantize(256).save(args.out, optimize=True)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
