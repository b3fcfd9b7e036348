"""Verification: whether a node's reply is the honest output of the block it claims to run.

Owns the range filters every reply passes (ranges.py), spot re-execution on the coordinator's verified
copy of a block (verifier.py), and re-execution on replicas with the same weights, judged by majority
(peer_check.py). A failed check yields a Lie with its evidence; convicting the node is membership's.
"""
