"""What every route needs, built once by the daemon and stored on each app's ``state``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from server.api.limits import Admission
from server.api.openai.responses import TokenText
from server.api.settings import ApiSettings
from server.engine.front.client import EngineClient
from server.web.api_keys import ApiKeys


@dataclass
class ServerState:
    settings: ApiSettings
    tokenizer: Any                 # server.text.tokenizer.Tokenizer
    engine: EngineClient           # AsyncEngine, or EngineProcess (the daemon's default)
    metrics: Any                   # server.metrics.ServingMetrics | NullMetrics
    admission: Admission
    generation_defaults: dict = field(default_factory=dict)
    chat_template: str | None = None   # models.<type>.chat_template file text; None: tokenizer's
    created: int = field(default_factory=lambda: int(time.time()))
    request_stop: Callable[[], None] = lambda: None   # POST /stopService -> daemon drain
    text_of: TokenText = None      # type: ignore[assignment]
    think_end_id: int | None = None
    api_keys: ApiKeys = field(default_factory=ApiKeys)   # none configured: open
    max_token_chars: int | None = None    # longest vocabulary entry: bounds text per token
    pd: Any = None                 # server.pd.instance.PDInstance in inferMode "dmi", else None

    def __post_init__(self) -> None:
        self.text_of = TokenText(self.tokenizer)
        try:
            vocab = self.tokenizer.backend_tokenizer.get_vocab()
            self.max_token_chars = max(map(len, vocab)) if vocab else None
        except Exception:             # a tokenizer without a vocabulary view: no early check
            self.max_token_chars = None
        try:
            ids = self.tokenizer.encode("</think>", add_special_tokens=False)
            self.think_end_id = ids[0] if len(ids) == 1 else None
        except Exception:
            self.think_end_id = None
