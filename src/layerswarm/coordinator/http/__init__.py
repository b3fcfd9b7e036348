"""The HTTP surface: everything a client or an operator reaches over HTTP.

Owns the app and its routes (app.py: the native /v1 API, classify.py and text.py; KServe v2 in
kserve.py; the swarm page in page.py), the front door every request passes (guarded_h11.py: deadlines
and a connection cap under uvicorn; front_door.py: API keys, statuses counted; access_log.py),
admission and bounded bodies (admission.py, bodies.py, reading.py, imaging.py), the one
classification behind every API (inference.py) and the errors and answers it gives (errors.py,
schemas.py, responses.py).
"""
