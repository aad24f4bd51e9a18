"""One FastAPI app per listening address; each carries the planes configured on it.

MindIE lets planes share an address: all three on one port, business + management on
one and metrics apart, or management + metrics together (the usual case).
"""
from __future__ import annotations

from fastapi import FastAPI

from server.api.errors import install_error_handlers
from server.api.planes.business import add_business_routes
from server.api.planes.management import add_management_routes, add_metrics_route
from server.api.planes.openapi import business_openapi
from server.api.planes.pd_routes import add_pd_routes
from server.api.state import ServerState

PLANES = ("business", "management", "metrics")


def build_app(state: ServerState, planes: set[str]) -> FastAPI:
    unknown = planes - set(PLANES)
    if unknown:
        raise ValueError(f"unknown planes {sorted(unknown)}")
    title = "mtp-serve " + "+".join(p for p in PLANES if p in planes)
    # Only the business plane publishes a schema (GET /openapi.json, open like /health).
    app = FastAPI(title=title, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if "business" in planes else None)
    app.state.server = state
    install_error_handlers(app)
    if "business" in planes:
        add_business_routes(app, state)
        doc = business_openapi(title, auth=state.api_keys.enabled)
        app.openapi = lambda: doc          # type: ignore[method-assign]
    if "management" in planes:
        add_management_routes(app, state, with_health="business" not in planes)
        add_pd_routes(app, state)
    if "metrics" in planes:
        add_metrics_route(app, state)
    return app
