"""What nodes and coordinators share on the wire, and nothing else: the gRPC messages (`v1/`, generated
from proto/), the tensor codec (`arrays.py` in numpy, `codec.py` its torch face), mDNS records
(`discovery.py`), the swarm token and TLS (`auth.py`, `security.py`), relay chains and their signed traces,
the shared EWMA (`stats.py`) and the one periodic task (`periodic.py`). The bottom layer: imports no
other layerswarm package.
"""
