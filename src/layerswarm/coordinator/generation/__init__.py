"""Generation: a decoder family's streams, token by token through the swarm, kept going when nodes fail.

Owns what a caller asks (options.py: GenerationOptions, checked against the model and the server's
limits), the one record per stream (session.py: StreamSession, with the route, every hop's inputs so a
lost cache can be rebuilt elsewhere, the sampling state and the trace), the route and what may stand in
for a hop (routes.py, pure), one Decode call (decode_call.py), moving a step's tokens through the route
with rebuilds, skips and rewinds after a caught lie (runner.py), what the caller may see of the text
(stops.py: stop sequences, held-back prefixes), and the streams themselves from open to release
(generator.py: Generator). Uses membership (nodes, channels), verification (decode checks) and routing
(DepthError, InvalidRequest); counts through a protocol it states (StreamObserver), handed the metrics.
"""
