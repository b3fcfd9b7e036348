"""Swarm membership: who is in the swarm, as the coordinator has proved it.

Owns the hints that say where to look (discovery.py: mDNS and DNS peers; peer_memory.py: the peers of
the last run), the proof of who a node is and whether it serves (health.py), keeping all that current
from start-up on (watch.py), the node records and their states (registry.py, records.py), the gRPC
channels to the nodes (clients.py), the measured links between them (linkmap.py), and what outlives a
node's record: convictions (convictions.py) and relay claims (claims.py). The registry and its
records are pure logic.
"""
