"""Failure injection: a swarm in which every node is its own host, faults on a seeded schedule, and a
load generator that records every request (`layerswarm chaos`)."""
