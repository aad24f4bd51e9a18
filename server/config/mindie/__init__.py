"""MindIE's ``config.json`` as this daemon reads it: one frozen pydantic model per section.

    sections.py   MindIEConfig and its sections (BackendConfig, ModelConfig, ScheduleConfig...)
    server.py     ServerConfig: the planes, their TLS, keys, limits and the PD part
    plugins.py    ModelConfig[i].plugin_params parsed into a typed object (MTP settings)
    base.py       what every section shares: camelCase aliases, frozen, unknown keys kept
"""
