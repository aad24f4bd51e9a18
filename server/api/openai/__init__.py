"""The OpenAI protocol as this server speaks it: what clients send and the pieces of what
they get back.  No server state here (serving/ runs the requests).

    protocol.py         strict pydantic models of the chat and completions bodies
    responses.py        usage, logprobs and finish reasons shared by chat and completions
    chat_output.py      generated text -> reasoning, content and tool-call deltas
    prompt_logprobs.py  prompt-token logprobs: OpenAI's echo block and vLLM's list
    grammars.py         response_format and tool calls as llguidance grammars
"""
