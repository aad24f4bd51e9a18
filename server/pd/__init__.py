"""Prefill/decode disaggregation: roles, the KV transfer between instances, the coordinator.

PD never imports server/api: the serving layer calls it (server/api/serving/pd_calls.py,
planes/pd_routes.py) and answers PD's refusals (errors.py) in its own error shape.

    instance.py    one daemon's part (inferMode "dmi"): its role, KV exports and pulls
    roles.py       the role state, assigned the MindIE way or fixed in the config
    errors.py      PDError and its kinds (refused 400, unavailable 503), without HTTP
    trust.py       signed kv_transfer_params and per-block digests: what D trusts
    wire.py        the KV transfer's wire format
    kv_exports.py  P's finished prompts' KV rows, held until D pulls them
    kv_server.py   P's KV port (asyncio TCP server)
    kv_client.py   D's pull from P
    tls.py         TLS for the KV link (interComm* keys)
    coordinator/   the coordinator (python -m server.pd, __main__.py): config, fleet,
                   routing, app
"""
