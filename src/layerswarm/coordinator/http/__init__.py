"""The HTTP surface: everything a client or an operator reaches over HTTP.

Owns the app and its routes, mounted by model family (app.py: images in classify.py, text in text.py,
KServe v2 in kserve.py, the swarm page in page.py, probes and metrics in ops.py), the front door every
request passes (guarded_h11.py: deadlines and a connection cap under uvicorn; front_door.py: API keys,
every status counted; access_log.py), admission and bounded bodies (admission.py, bodies.py,
reading.py, imaging.py), the one classification behind every API (inference.py), and the errors and
answers it gives (errors.py, schemas.py, responses.py). It reads the running coordinator through
service.py, never the process module above it.
"""
