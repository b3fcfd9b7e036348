"""Routing: one request's way through the swarm, from the stem's output to the head's input.

Owns the request (request.py: ClassifyOptions, what the caller asked; Request, what the router settled),
the router that runs it (router.py: stem, routes, head), the plan (planner.py, netorder.py), walking it
hop by hop around failures (executor.py, hop_call.py, deferred checks in deferred.py), early exit
(exits.py), ensembles (ensemble.py, members.py), the wire dtype per link (wire_choice.py), star or relay
per route (topology.py), and the trace a request answers with (trace.py).
"""
