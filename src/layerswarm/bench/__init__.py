"""layerswarm's benchmark suite: `layerswarm bench [--quick] [--json FILE]` (see bench/README.md)."""
