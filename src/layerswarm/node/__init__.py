"""A node: one block of one model, served over gRPC and advertised over mDNS.

`server.py` runs the process (settings, TLS or token, health, mDNS advertisement via `advertise.py`);
`service.py` answers Forward, Info and the relay calls; `runtime.py` holds the block behind an engine
(`engines/`: torch, or numpy without torch); `streams.py`, `decode.py` and `decode_batch.py` keep each
stream's KV cache and batch decode steps; `checks.py` refuses malformed or oversized input before any
compute; `relay.py` and `outbox.py` forward along MACed chains. Nothing here imports the coordinator.
"""
