"""Relay: consecutive hops sent as one chain that the nodes forward to each other (docs/relay.md).

Owns running chains and collecting their results (chains.py), checking a chain's signed trace before
believing it (chain_trace.py), and trying a hand-back's claim before it counts against anyone
(handbacks.py). Star steps inside a relay route go through routing's executor.
"""
