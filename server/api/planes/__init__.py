"""The routes of each plane, mounted by app.py on the listeners that carry the plane.

    business.py     business plane: the OpenAI routes and /health (API key, body, slot)
    management.py   management plane (status, config, stopService...) and the metrics route
    pd_routes.py    PD's management routes: MindIE's role API, the coordinator's KV release
    openapi.py      the business plane's OpenAPI document, from the request models
"""
