"""One fixed set of requests whose answers two daemons must agree on, token for token:
greedy, seeded and streamed chat, a plain completion, a tool call and a reasoning answer."""
from __future__ import annotations

import openai

from server.testing.daemon import MODEL_NAME

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
LONG = ("Tell me a story about a dragon who lived in the mountains above a small village, "
        "and who one day decided to visit the baker because the smell of bread was too good.")
QUESTIONS = ["What is 12 plus 30?", "What is the capital of France?", LONG]
# MTP k=2, fixed (no adaptive speculation), so two daemons' acceptance counters can be compared.
K2 = {"plugin_params": '{"plugin_type":"mtp","num_speculative_tokens":2,"adaptive_speculation":false}'}


def answers(base: str) -> list:
    """Index 3 * len(QUESTIONS) is the completion of LONG."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)
    out = []
    for i, q in enumerate(QUESTIONS):
        msgs = [{"role": "user", "content": q}]
        r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=40, temperature=0)
        out.append(r.choices[0].message.content)
        r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=40,
                                           temperature=0.9, seed=100 + i)
        out.append(r.choices[0].message.content)
        out.append("".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL_NAME, messages=msgs, max_tokens=40, temperature=0, stream=True) if c.choices))
    r = client.completions.create(model=MODEL_NAME, prompt=LONG, max_tokens=24, temperature=0)
    out.append(r.choices[0].text)
    r = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=48, temperature=0, tools=TOOLS,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    out.append([(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []])
    r = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "What is 7 times 6?"}],
        extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    out.append((getattr(m, "reasoning_content", None), m.content))
    return out


def metric(metrics_url: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples (those whose line holds ``label``) on a /metrics page."""
    import httpx
    total = 0.0
    for line in httpx.get(metrics_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.split()[-1])
    return total
