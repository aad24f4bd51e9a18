"""The PD coordinator (MindIE-MS's part): the one business endpoint clients call, in
front of prefill (P) and decode (D) instances.  ``python -m server.pd`` runs it.

  config.py   the coordinator's config file (conf/pd/coordinator.json) and its instances
  fleet.py    the instances: start-up checks, role assignment, the health loop, their load
  routing.py  one request through P then D: signed params, retries, KV release, relay
  app.py      the FastAPI app (routes, error handlers), uvicorn's config, serve, main
"""
