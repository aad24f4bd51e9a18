"""DeepSeek V3 / V3.1 tool-call parsing: full text, streaming at every split point, malformed text."""
import json
import random

import pytest

from server.text.tool_calls import DeepSeekV3ToolParser, DeepSeekV31ToolParser, make_tool_call_id

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3_call(name, args):
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


def v31_call(name, args):
    return f"{CB}{name}{SEP}{args}{CE}"


ARGS1 = '{"city": "Paris", "note": "été 😀"}'
ARGS2 = '{"tz": "CET", "nested": {"a": [1, 2, "x```y"]}}'

# (parser class, text, expected content, expected [(name, args)])
GOOD = [
    (DeepSeekV3ToolParser, B + v3_call("get_weather", ARGS1) + E, None, [("get_weather", ARGS1)]),
    (DeepSeekV3ToolParser, "Let me check.\n\n" + B + v3_call("get_weather", ARGS1) + "\n" + v3_call("get_time", ARGS2) + E,
     "Let me check.\n\n", [("get_weather", ARGS1), ("get_time", ARGS2)]),
    (DeepSeekV3ToolParser, B + v3_call("f", "{}"), None, [("f", "{}")]),  # missing section end
    (DeepSeekV3ToolParser, B + v3_call("f", "{}") + E + " trailing", " trailing", [("f", "{}")]),
    (DeepSeekV3ToolParser, B + f"{CB}function{SEP}f\n```json\n[1]```{CE}" + E, None, [("f", "[1]")]),  # fence w/o newline
    (DeepSeekV3ToolParser, "\n\n" + CB + f"function{SEP}g\n```json\n{{\"k\": 1}}\n```{CE}", None, [("g", '{"k": 1}')]),
    (DeepSeekV31ToolParser, B + v31_call("get_weather", ARGS1) + E, None, [("get_weather", ARGS1)]),
    (DeepSeekV31ToolParser, "ok " + B + v31_call("a", ARGS1) + v31_call("b", ARGS2) + E, "ok ",
     [("a", ARGS1), ("b", ARGS2)]),
]

NO_CALLS = [
    (DeepSeekV3ToolParser, "Plain answer with < and <｜ and ``` but no calls."),
    (DeepSeekV3ToolParser, ""),
    (DeepSeekV31ToolParser, "Text mentioning <｜tool▁sep｜> alone."),
]

MALFORMED = [
    (DeepSeekV3ToolParser, "x" + B + "garbage"),
    (DeepSeekV3ToolParser, B + v3_call("f", "{not json}") + E),
    (DeepSeekV3ToolParser, B + f"{CB}function{SEP}f\n```json\n" + '{"a": 1'),            # truncated
    (DeepSeekV3ToolParser, B + f"{CB}function{SEP}f\n```python\n{{}}\n```{CE}" + E),       # wrong fence
    (DeepSeekV3ToolParser, B + f"{CB}function{SEP}\n```json\n{{}}\n```{CE}" + E),          # empty name
    (DeepSeekV3ToolParser, B + f"{CB}function{SEP}f"),                                   # header cut
    (DeepSeekV3ToolParser, B),
    (DeepSeekV3ToolParser, B + v3_call("f", "{}") + "junk" + E),
    (DeepSeekV3ToolParser, B + v31_call("f", "{}") + E),                                  # V3.1 text, V3 parser
    (DeepSeekV31ToolParser, B + v3_call("f", "{}") + E),                                  # V3 text, V3.1 parser
    (DeepSeekV31ToolParser, B + f"{CB}na\nme{SEP}{{}}{CE}" + E),
]


def _blank_as_empty(content: str) -> str:
    # Full parsing reports whitespace-only content next to tool calls as None; a stream has
    # already sent that whitespace, which clients render as nothing.
    return content if content.strip() else ""


def _stream(parser, chunks):
    s = parser.stream()
    deltas = [s.feed(c) for c in chunks] + [s.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls:
            i = tc["index"]
            if i not in calls:
                # The first delta of a call carries id, type and name; later ones only arguments.
                assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                calls[i] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[i]["arguments"] += tc["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], s


@pytest.mark.parametrize("cls,text,content,calls", GOOD)
def test_full_extraction(cls, text, content, calls):
    res = cls().extract(text)
    assert res.content == content
    assert [(c.name, c.arguments) for c in res.tool_calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in res.tool_calls)
    assert len({c.id for c in res.tool_calls}) == len(calls)
    assert res.tool_calls[0].to_openai()["function"]["arguments"] == calls[0][1]


@pytest.mark.parametrize("cls,text,content,calls", GOOD)
def test_streaming_any_split_equals_full(cls, text, content, calls):
    p = cls()
    want = (content or "", calls)
    def run(chunks):
        got_content, got_calls, s = _stream(p, chunks)
        return _blank_as_empty(got_content), got_calls

    assert run(list(text)) == want
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]]) == want, i
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), k=rng.randint(1, 8)))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        got_content, got_calls, s = _stream(p, chunks)
        assert (_blank_as_empty(got_content), got_calls) == want
        res = s.result()
        assert [(c.name, c.arguments) for c in res.tool_calls] == calls


@pytest.mark.parametrize("cls,text", NO_CALLS)
def test_plain_text_passes_through(cls, text):
    assert cls().extract(text).content == (text or None)
    assert cls().extract(text).tool_calls == []
    for i in range(len(text) + 1):
        content, calls, _ = _stream(cls(), [text[:i], text[i:]])
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("cls,text", MALFORMED)
def test_malformed_comes_back_as_content(cls, text):
    res = cls().extract(text)
    assert res.tool_calls == [] and res.content == text
    # Streaming never raises, and never loses text before a call was announced.
    for i in range(len(text) + 1):
        content, calls, s = _stream(cls(), [text[:i], text[i:]])
        assert s.result().tool_calls == []
        if not calls:
            assert content == text


def test_streaming_holds_back_partial_markers():
    s = DeepSeekV3ToolParser().stream()
    assert s.feed("Hello <｜tool").content == "Hello "
    d = s.feed("▁calls▁begin｜>" + CB + "function" + SEP + "get_weather\n```js")
    assert d.content == "" and d.tool_calls == []
    d = s.feed('on\n{"city": "Par')
    assert d.tool_calls == [{"index": 0, "id": d.tool_calls[0]["id"], "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]
    d = s.feed('is"}\n``')
    assert d.tool_calls == [{"index": 0, "function": {"arguments": 'is"}'}}]  # "\n``" held back
    d = s.feed("`" + CE + E)
    assert not d
    assert s.finish().content == ""
    assert json.loads(s.tool_calls[0].arguments) == {"city": "Paris"}


def test_fuzz_never_raises():
    pieces = [B, E, CB, CE, SEP, "function", "f", "\n", "```json\n", "\n```", "{", "}", '"a"', ":", "1", " ", "x",
              "<｜", "tool", "▁"]
    rng = random.Random(3)
    for cls in (DeepSeekV3ToolParser, DeepSeekV31ToolParser):
        for _ in range(1500):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
            res = cls().extract(text)
            if not res.tool_calls:
                assert res.content == (text or None)
            else:
                for c in res.tool_calls:
                    json.loads(c.arguments)
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(3, len(text) + 1)))
            _stream(cls(), [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])


def test_ids_are_unique():
    ids = {make_tool_call_id() for _ in range(1000)}
    assert len(ids) == 1000
