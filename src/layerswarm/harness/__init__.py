"""What tests, benchmarks and `layerswarm chaos` drive a swarm with: child processes and their ready
lines, private network namespaces and emulated LANs (veth, bridges, tc shaping), failure injection,
forged peers, samples and the headless browser. Nothing a node or coordinator imports."""
