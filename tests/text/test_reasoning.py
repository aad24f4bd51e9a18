"""R1 reasoning split: full text, streaming at every split point, token counting."""
import random

import pytest

from server.text.reasoning import ReasoningParser, ReasoningTokenCounter, count_reasoning_tokens

CASES = [
    # (model output, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", "\nLet me see.\n", "The answer is 4."),
    # The newlines R1 puts after </think> are a separator, not content (DeepSeek's API).
    ("r</think>\n\n", "r", None),
    ("r</think>\n\n\nA\n\nB\n", "r", "A\n\nB\n"),
    ("r</think> \nA", "r", " \nA"),
    ("Prompt opened think. 2+2=4</think>Four.", "Prompt opened think. 2+2=4", "Four."),
    ("no end marker, cut by max_tokens", "no end marker, cut by max_tokens", None),
    ("<think>only reasoning", "only reasoning", None),
    ("</think>just content", None, "just content"),
    ("<think></think>", None, None),
    ("reason</think>content with </think> inside", "reason", "content with </think> inside"),
    ("a <think> in the middle</think>x", "a <think> in the middle", "x"),
    ("<thin", "<thin", None),
    ("<think>", None, None),
    ("</thi", "</thi", None),
    ("思考😀中</think>答案", "思考😀中", "答案"),
    ("", None, None),
]


def _stream(parser, chunks):
    s = parser.stream()
    r, c = [], []
    for ch in chunks:
        dr, dc = s.feed(ch)
        r.append(dr)
        c.append(dc)
    dr, dc = s.finish()
    return "".join(r + [dr]), "".join(c + [dc])


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_full(text, reasoning, content):
    assert ReasoningParser().extract(text) == (reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_streaming_every_split(text, reasoning, content):
    p = ReasoningParser()
    want = (reasoning or "", content or "")
    assert _stream(p, list(text)) == want
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _stream(p, [text[:i], text[i:j], text[j:]]) == want, (i, j)


def test_streaming_random_chunks_and_state():
    p = ReasoningParser()
    rng = random.Random(1)
    for text, reasoning, content in CASES * 20:
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _stream(p, chunks) == (reasoning or "", content or "")
    s = p.stream()
    assert s.feed("<think>abc</th") == ("abc", "") and s.in_reasoning
    assert s.feed("ink>ans") == ("", "ans") and not s.in_reasoning
    assert s.feed("</think>more") == ("", "</think>more")


def test_reasoning_token_counts():
    end = 895
    assert count_reasoning_tokens([5, 6, 7, end, 8, 9], end) == 4
    assert count_reasoning_tokens([5, 6, 7], end) == 3
    assert count_reasoning_tokens([], end) == 0
    c = ReasoningTokenCounter(end)
    c.feed([5, 6])
    c.feed([7, end, 8])  # an MTP step that crosses the marker
    assert c.feed([9]) == 4 and c.done


def test_counts_match_text_split(tok):
    """Token-id counting agrees with where the text parser puts the boundary."""
    ids = tok.encode("<think>\nsome reasoning here</think>\n\nthe answer")
    end = tok.token_to_id("</think>")
    n = count_reasoning_tokens(ids, end)
    reasoning, content = ReasoningParser().extract(tok.decode(ids))
    assert tok.decode(ids[:n]) == "<think>" + reasoning + "</think>"
    # The separator newlines after </think> are output tokens, but not content text.
    assert tok.decode(ids[n:]) == "\n\n" + content
