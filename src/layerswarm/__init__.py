"""layerswarm: distributed edge inference, one transformer block per network node, routed in any order."""

__version__ = "0.1.0"
