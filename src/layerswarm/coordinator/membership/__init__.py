"""Swarm membership: who is in the swarm, as the coordinator has proved it.

Owns the hints that say where to look (mDNS, static and DNS peers, the peers remembered from the last
run), the proof of who a node is (its authenticated Info) and whether it serves (health checks), the
node records and their states (the registry), the gRPC channels to the nodes, the measured links
between them, and what outlives a node's record: convictions and relay claims. The registry and
its records are pure logic; I/O is in discovery, health and clients.
"""
