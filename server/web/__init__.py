"""HTTP pieces the daemon (server/api) and the PD coordinator (server/pd/coordinator) share,
below both: neither plane's package is imported here.  (Not named ``http``: a process
started with ``server/`` as its working directory would then shadow the standard library.)

    errors.py          APIError and the OpenAI / MindIE error bodies and responses
    body.py            a JSON body read with a size cap and a deadline (413, 408, 400)
    header_timeout.py  uvicorn's h11 protocol with a deadline for request headers (408)
    offload.py         the planning pool: decoding, validation, tokenizing off the loop
    api_keys.py        API keys: Bearer tokens compared in constant time (401)
    tls_files.py       a TLS file set (cert, key, password file, CAs, CRLs) and its
                       server SSLContext, for the HTTP planes and the PD KV link
"""
