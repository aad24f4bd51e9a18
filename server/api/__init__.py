"""The daemon's HTTP planes (business, management, metrics) over the engine.

Dependencies point down: this package uses server/pd (the PD instance), server/web (the
pieces it shares with the PD coordinator), server/engine and server/text; none of them
imports it.

    app.py          one FastAPI app per listening address, with the planes configured on it
    state.py        ServerState: what every route needs, built once by the daemon
    settings.py     the slice of AppConfig the HTTP layer reads
    auth.py         the guard on state-changing management calls (origin, API key)
    errors.py       the daemon's exception handlers: OpenAI's shape on /v1, MindIE's elsewhere
    limits.py       admission: maxLinkNum slots and the drain switch
    sse.py          JSON responses and server-sent-event framing
    tls.py          each plane's TLS from MindIE's keys, checked before any port is bound
    planes/         the routes of each plane
      business.py     business plane: the OpenAI routes and /health (API key, body, slot)
      management.py   management plane (status, config, stopService...) and the metrics route
      pd_routes.py    PD's management routes: MindIE's role API, the coordinator's KV release
      openapi.py      the business plane's OpenAPI document, from the request models
    openai/         the OpenAI protocol: request models, response pieces, output parsers,
                    prompt logprobs, structured-output grammars
    serving/        the chat and completions handlers, the engine calls they make and their
                    calls into PD (pd_calls.py: PD's refusals become APIErrors)
"""
