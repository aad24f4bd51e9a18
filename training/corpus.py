"""Synthetic chats (questions, reasoning, tool calls) and prose for the demo model.

Every chat is a ``Chat``: OpenAI-style messages whose last entry is the assistant turn the
model should learn to write, plus the tool list and the thinking flag. Rendering to text is
done by ``render.py`` with the project's chat template, so the model learns exactly the
format the daemon will feed it.

Held-out split: a user prompt is *held out* when it names an evaluation-only value (city,
word, topic) or when a stable hash of its text falls in the held-out bucket. Training only
emits prompts that are not held out; the evaluation only asks prompts that are, so the
evaluation never repeats a training prompt.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from . import facts as F

HELDOUT_BUCKETS = 10          # 1 in 10 prompt texts (by CRC32) is evaluation-only


@dataclass
class Chat:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    thinking: bool = False
    kind: str = "qa"                       # qa | tool | smalltalk
    expect_tool: str | None = None         # function name the first assistant turn must call
    expect_args: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _eval_values() -> list[str]:
    return F.EVAL_CITIES + F.EVAL_WORDS + F.EVAL_TOPICS


_EVAL_VALUES = [v.lower() for v in _eval_values()]


def is_heldout(prompt: str) -> bool:
    """True when ``prompt`` belongs to the evaluation side of the split."""
    low = prompt.lower()
    if any(v in low for v in _EVAL_VALUES):
        return True
    return zlib.crc32(prompt.encode("utf-8")) % HELDOUT_BUCKETS == 0


# --------------------------------------------------------------------------------------
# Tools

def _tool(name: str, desc: str, props: dict[str, tuple[str, str]]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, (t, _d) in props.items()},
                "required": list(props),
            },
        },
    }


TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _tool("get_weather", "Get the current weather in a city.",
                         {"city": ("string", "Name of the city")}),
    "get_time": _tool("get_time", "Get the current local time in a city.",
                      {"city": ("string", "Name of the city")}),
    "add": _tool("add", "Add two numbers.",
                 {"a": ("number", "First number"), "b": ("number", "Second number")}),
    "search": _tool("search", "Search the web and return the top result.",
                    {"query": ("string", "What to search for")}),
    "convert_units": _tool("convert_units", "Convert a value from one unit to another.",
                           {"value": ("number", "The value"), "from_unit": ("string", "Unit to convert from"),
                            "to_unit": ("string", "Unit to convert to")}),
}


def tool_list(rng: random.Random, must: str | None, exclude: set[str] = frozenset()) -> list[dict[str, Any]]:
    """A shuffled subset of the tools: always ``must`` (if given), never ``exclude``."""
    names = [n for n in TOOLS if n != must and n not in exclude]
    rng.shuffle(names)
    chosen = names[: rng.randint(1, 2) if must else rng.randint(1, 3)]   # at most 3 tools: short prompts
    if must:
        chosen.append(must)
    rng.shuffle(chosen)
    return [TOOLS[n] for n in chosen]


# --------------------------------------------------------------------------------------
# Direct questions: each returns (prompt, answer, reasoning, domain tool to avoid)

QA = tuple[str, str, str, str | None]


def q_capital(rng: random.Random, split: str) -> QA:
    c = rng.choice(list(F.COUNTRIES)); cap = F.COUNTRIES[c][0]
    p = rng.choice(["What is the capital of {c}?", "Which city is the capital of {c}?", "Tell me the capital of {c}.",
                    "Name the capital city of {c}.", "What's the capital city of {c}?", "Capital of {c}?"]).format(c=c)
    return (p, f"The capital of {c} is {cap}.",
            f"The user asks for the capital of {c}. The capital of {c} is {cap}. So the answer is {cap}.", None)


def q_continent(rng: random.Random, split: str) -> QA:
    c = rng.choice(list(F.COUNTRIES)); cont = F.COUNTRIES[c][1]
    p = rng.choice(["Which continent is {c} in?", "On which continent is {c}?", "Where is {c} located?",
                    "{c} is on which continent?"]).format(c=c)
    return (p, f"{c} is in {cont}.",
            f"The user asks where {c} is. {c} is a country in {cont}. So the answer is {cont}.", None)


def q_language(rng: random.Random, split: str) -> QA:
    c = rng.choice(list(F.COUNTRIES)); lang = F.COUNTRIES[c][2]
    p = rng.choice(["What language is spoken in {c}?", "What is the main language of {c}?",
                    "Which language do people speak in {c}?"]).format(c=c)
    return (p, f"The main language of {c} is {lang}.",
            f"The user asks about the language of {c}. People in {c} mainly speak {lang}. So the answer is {lang}.", None)


def q_symbol(rng: random.Random, split: str) -> QA:
    e = rng.choice(list(F.ELEMENTS)); sym, num = F.ELEMENTS[e]
    if rng.random() < 0.5:
        p = rng.choice(["What is the chemical symbol for {e}?", "What is the symbol of {e}?",
                        "Give me the element symbol of {e}."]).format(e=e)
        return (p, f"The chemical symbol for {e} is {sym}.",
                f"The user asks for the symbol of {e}. The symbol of {e} is {sym}. So the answer is {sym}.", None)
    p = rng.choice(["What is the atomic number of {e}?", "How many protons does {e} have?"]).format(e=e)
    return (p, f"The atomic number of {e} is {num}.",
            f"The user asks for the atomic number of {e}. {e.capitalize()} has {num} protons. So the answer is {num}.", None)


def q_arith(rng: random.Random, split: str) -> QA:
    op = rng.choice("+-*")
    if op == "+":
        a, b = rng.randint(0, 99), rng.randint(0, 99); c = a + b
        p = rng.choice(["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}."])
        think = f"I need to add {a} and {b}. {a} + {b} = {c}. So the answer is {c}."
    elif op == "-":
        a, b = rng.randint(0, 99), rng.randint(0, 99); a, b = max(a, b), min(a, b); c = a - b
        p = rng.choice(["What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}."])
        think = f"I need to subtract {b} from {a}. {a} - {b} = {c}. So the answer is {c}."
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12); c = a * b
        p = rng.choice(["What is {a} times {b}?", "What is {a} * {b}?", "Multiply {a} by {b}."])
        think = f"I need to multiply {a} by {b}. {a} * {b} = {c}. So the answer is {c}."
    return p.format(a=a, b=b), f"{a} {op} {b} = {c}.", think, "add"


def q_convert(rng: random.Random, split: str) -> QA:
    (u1, u2), f = rng.choice(list(F.UNITS.items())); v = rng.randint(1, 50); r = v * f
    p = rng.choice(["Convert {v} {u1} to {u2}.", "How many {u2} are in {v} {u1}?", "What is {v} {u1} in {u2}?"])
    return (p.format(v=v, u1=u1, u2=u2), f"{v} {u1} is {r} {u2}.",
            f"The factor from {u1} to {u2} is {f}. {v} * {f} = {r}. So {v} {u1} is {r} {u2}.", "convert_units")


def _words(split: str) -> list[str]:
    return F.EVAL_WORDS if split == "eval" else F.TRAIN_WORDS


def q_string(rng: random.Random, split: str) -> QA:
    w = rng.choice(_words(split)); spelled = "-".join(w)
    kind = rng.randrange(4)
    if kind == 0:
        p = rng.choice(["How many letters are in the word {w}?", "Count the letters in {w}."]).format(w=w)
        return (p, f"The word {w} has {len(w)} letters.",
                f"Let me spell the word: {spelled}. That is {len(w)} letters. So the answer is {len(w)}.", None)
    if kind == 1:
        p = rng.choice(["What is the first letter of the word {w}?", "Which letter does {w} start with?"]).format(w=w)
        return (p, f"The word {w} starts with the letter {w[0]}.",
                f"Let me spell the word: {spelled}. The first letter is {w[0]}. So the answer is {w[0]}.", None)
    if kind == 2:
        p = rng.choice(["Spell the word {w}.", "How do you spell {w}?"]).format(w=w)
        return (p, f"{w} is spelled {spelled}.",
                f"I need to split {w} into letters: {spelled}. So the answer is {spelled}.", None)
    p = rng.choice(["Repeat the word {w} three times.", "Say {w} three times."]).format(w=w)
    return (p, f"{w} {w} {w}", f"The user wants the word {w} three times. So the answer is {w} {w} {w}.", None)


def q_smalltalk(rng: random.Random, split: str) -> QA:
    p, a = rng.choice(F.SMALL_TALK)
    return p, a, f"The user says: {p} I should reply politely and briefly.", None


QUESTION_KINDS: list[tuple[Callable[[random.Random, str], QA], float]] = [
    (q_capital, 2.0), (q_continent, 1.0), (q_language, 1.0), (q_symbol, 1.5), (q_arith, 2.0),
    (q_convert, 1.0), (q_string, 2.0), (q_smalltalk, 0.5),
]


# --------------------------------------------------------------------------------------
# Tool tasks: each returns (prompt, [(name, args)], [result dict], final answer)

ToolTask = tuple[str, list[tuple[str, dict[str, Any]]], list[dict[str, Any]], str]


def _cities(split: str) -> list[str]:
    if split == "eval":
        return F.EVAL_CITIES
    return copy_city_pool() if split == "copy" else F.TRAIN_CITIES


# --------------------------------------------------------------------------------------
# The copy stage (stage 3): weather / time requests over thousands of distinct city names and
# more phrasings, so the argument can only be right when copied from the prompt. Split
# "copy" is training data ("train" in all else); the phrasings in HELDOUT_* are never trained.

COPY_NAME_COUNT = 4000
COPY_NAME_SEED = 4711

WEATHER_PHRASINGS = ["What's the weather like in {c}?", "What is the weather in {c} today?", "Check the weather in {c}.",
                     "Is it raining in {c} right now?", "How warm is it in {c}?", "Weather in {c}, please."]
TIME_PHRASINGS = ["What time is it in {c}?", "Tell me the current time in {c}.", "What is the local time in {c}?",
                  "Get the time in {c}."]
COPY_WEATHER_PHRASINGS = WEATHER_PHRASINGS + [
    "How is the weather in {c}?", "Tell me the weather in {c}.", "What's the forecast for {c}?", "Is it cold in {c}?",
    "Give me the weather for {c}.", "I am going to {c}. What is the weather there?", "Do I need an umbrella in {c}?",
    "Weather report for {c}, please.", "{c} weather?", "Can you check the weather in {c} for me?",
    "Is it sunny in {c}?", "What is the temperature in {c}?", "Any rain in {c} today?", "Show me the weather in {c}.",
]
COPY_TIME_PHRASINGS = TIME_PHRASINGS + [
    "What's the time in {c}?", "Current time in {c}, please.", "Do you know the time in {c}?",
    "Check the clock in {c}.", "What hour is it in {c}?", "Tell me what time it is in {c}.",
    "I need the local time in {c}.", "{c} time?",
]
HELDOUT_WEATHER_PHRASINGS = [
    "What is the weather in {c}?", "What's the weather in {c} right now?", "Could you tell me the weather in {c}?",
    "How hot is it in {c} today?", "Please look up the weather for {c}.", "Is it snowing in {c}?",
]
HELDOUT_TIME_PHRASINGS = [
    "What time is it now in {c}?", "Could you tell me the time in {c}?", "Look up the local time for {c}.",
    "Time in {c}?",
]


def _normal(phrasing: str) -> str:
    """A phrasing with case, punctuation and filler words ("please", "today", "now") dropped: two
    phrasings equal here say the same thing, so one held out must keep the other out of training."""
    words = re.findall(r"[a-z{}']+", phrasing.lower())
    return " ".join(w for w in words if w not in {"please", "today", "now", "right", "me", "for"})


def _composed(asks: list[str], nouns: list[str], terse: list[str], questions: list[str],
              held_out: list[str]) -> list[str]:
    """Requests put together from parts (an opener, what is asked for, a preposition, an ending),
    terse forms ("Forecast for {c}?") and yes/no questions; none equal to a held-out phrasing
    once normalised (_normal)."""
    out = [f"{a} {n} {p} {{c}}{e}" for a in asks for n in nouns for p in ("in", "for")
           for e in (".", "?", ", please.", " today.", " right now.")]
    out += [f"{t} {p} {{c}}{e}" for t in terse for p in ("in", "for") for e in ("?", ".", ", please.")]
    out += questions
    banned = {_normal(h) for h in held_out}
    return sorted({p for p in out if _normal(p) not in banned})


ASKS = ["Tell me", "Give me", "Show me", "Check", "Find", "Get", "Please check", "Can you check",
        "Can you get", "Would you check", "I want to know", "I'd like to know", "Let me know",
        "Fetch", "Report"]
COMPOSED_WEATHER_PHRASINGS = _composed(
    ASKS, ["the weather", "the current weather", "today's weather", "the forecast", "the weather forecast",
           "the temperature", "the current temperature", "the weather conditions"],
    ["Weather", "Forecast", "Temperature", "The weather", "Current weather", "Weather report"],
    [f"Is it {w} in {{c}}{e}" for w in ("raining", "sunny", "cold", "warm", "windy", "cloudy", "foggy", "humid",
                                        "freezing", "nice out") for e in ("?", " today?", " at the moment?")]
    + [f"{q} in {{c}}?" for q in ("How is the weather", "What's it like outside", "How cold is it", "How warm is it",
                                  "Will it rain", "Do I need a jacket", "What's the temperature")],
    HELDOUT_WEATHER_PHRASINGS)
COMPOSED_TIME_PHRASINGS = _composed(
    ASKS, ["the time", "the current time", "the local time", "the time of day", "the current local time",
           "the hour", "the clock time"],
    ["Local time", "Current time", "The time", "Clock", "The local time", "Hour"],
    [f"{q} in {{c}}{e}" for q in ("What time is it", "What's the time", "What hour is it", "How late is it",
                                  "Is it morning", "Is it night", "Is it late")
     for e in ("?", " at the moment?", " currently?")],
    HELDOUT_TIME_PHRASINGS)

_COPY_POOL: list[str] = []


def copy_names(seed: int = COPY_NAME_SEED, n: int = COPY_NAME_COUNT) -> list[str]:
    """``n`` distinct made-up place names from syllables (seeded), none naming an evaluation value."""
    rng = random.Random(seed)
    known = set(F.TRAIN_CITIES) | set(F.COPY_CITIES) | set(F.EVAL_CITIES)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n:
        word = "".join(rng.choice(F.NAME_ONSETS) + rng.choice(F.NAME_VOWELS) + rng.choice(F.NAME_CODAS)
                       for _ in range(rng.choice((1, 2, 2, 2, 3, 3))))
        if len(word) < 3 or len(word) > 11:
            continue
        name = word.capitalize()
        if rng.random() < 0.12:
            name = rng.choice(F.NAME_AFFIXES).format(name)
        if name in seen or name in known or any(v in name.lower() for v in _EVAL_VALUES):
            continue
        seen.add(name)
        names.append(name)
    return names


COPY_WORD_COUNT = 3000


def _prose_words() -> list[str]:
    """The prose's lowercase words of 4-10 letters, sorted: the stock made-up names and topics draw from."""
    return sorted({w for d in prose_documents() for w in re.findall(r"\b[a-z]{4,10}\b", d)})


def copy_words(seed: int = COPY_NAME_SEED + 1, n: int = COPY_WORD_COUNT) -> list[str]:
    """``n`` capitalised English words from the prose (seeded pick), as more made-up place names:
    their pieces are those of real words, which syllable names alone do not cover."""
    words = _prose_words()
    known = {c.lower() for c in F.TRAIN_CITIES + F.COPY_CITIES + F.EVAL_CITIES}
    words = [w for w in words if w not in known and not any(v in w for v in _EVAL_VALUES)]
    return [w.capitalize() for w in random.Random(seed).sample(words, min(n, len(words)))]


PIECE_NAME_COUNT = 6000


def piece_names(tok, seed: int = COPY_NAME_SEED + 2, n: int = PIECE_NAME_COUNT) -> list[str]:
    """``n`` made-up names spelt from the tokenizer's own pieces: a capitalised piece, then one
    to three lowercase ones, the lowercase pieces dealt in turn so each comes up about equally.

    A copy head learns to carry a piece's identity only for pieces it has copied. Syllable
    names and capitalised words cover fewer than half of the vocabulary's lowercase pieces
    (``gen``, ``burg``, ``ago`` never or once), and an unseen name is as likely to need any of
    them. None names an evaluation value."""
    vocab = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
    heads = sorted(p for p in vocab if p.isalpha() and p.isascii() and p[0].isupper() and p[1:].islower())
    tails = sorted(p for p in vocab if p.isalpha() and p.isascii() and p.islower())
    rng = random.Random(seed)
    deck: list[str] = []
    known = {c.lower() for c in F.TRAIN_CITIES + F.COPY_CITIES + F.EVAL_CITIES}
    names: list[str] = []
    seen: set[str] = set()
    for _ in range(50 * n):                      # bounded: a small vocabulary has fewer names
        if len(names) == n:
            break
        parts = [rng.choice(heads)]
        for _ in range(rng.choice((1, 1, 2, 2, 3))):
            if not deck:
                deck = tails[:]
                rng.shuffle(deck)
            parts.append(deck.pop())
        name = "".join(parts)
        low = name.lower()
        if len(name) > 14 or name in seen or low in known or any(v in low for v in _EVAL_VALUES):
            continue
        seen.add(name)
        names.append(name)
    return names


_PIECE_NAMES: list[str] = []
_PIECE_NAMES_ASKED: list[int] = []      # the n that _PIECE_NAMES was made for (a small vocabulary gives fewer)


def use_piece_names(tok, n: int = PIECE_NAME_COUNT) -> int:
    """Add ``piece_names(tok, n=n)`` to the copy stage's city pool (they depend on the vocabulary,
    which the corpus does not know by itself); call before the first copy chat is made. Returns
    how many there are."""
    if _PIECE_NAMES_ASKED != [n]:
        _PIECE_NAMES[:] = piece_names(tok, n=n)
        _PIECE_NAMES_ASKED[:] = [n]
        _COPY_POOL.clear()
    return len(_PIECE_NAMES)


def copy_city_pool() -> list[str]:
    """Training cities, the extra real ones, made-up names, capitalised words and (after
    use_piece_names) names spelt from the vocabulary's pieces: the copy stage's city pool."""
    if not _COPY_POOL:
        _COPY_POOL.extend(dict.fromkeys(F.TRAIN_CITIES + F.COPY_CITIES + copy_names() + copy_words() + _PIECE_NAMES))
    return _COPY_POOL


TERSE_WEATHER_PHRASINGS = ["Forecast for {c}?", "Temperature in {c}?", "Rain in {c}?", "Weather for {c}?",
                           "Conditions in {c}?"]
TERSE_TIME_PHRASINGS = ["Local time in {c}?", "Current time in {c}?", "Clock in {c}?", "Hour in {c}?",
                        "Local time for {c}?"]
_EXTRA: dict[str, list[str]] = {"weather": [], "time": []}


def use_extra_phrasings(composed: bool = False, terse: bool = False) -> None:
    """Widen the copy split's weather / time requests (call before the first chat is made):
    ``composed`` adds COMPOSED_*_PHRASINGS, ``terse`` the few TERSE_* ones. A call must pick its
    function from what is asked; twenty fixed phrasings teach the phrasings rather than the words
    ("Time in X?" -> get_weather). Neither holds a held-out phrasing."""
    _EXTRA["weather"] = (COMPOSED_WEATHER_PHRASINGS if composed else []) + (TERSE_WEATHER_PHRASINGS if terse else [])
    _EXTRA["time"] = (COMPOSED_TIME_PHRASINGS if composed else []) + (TERSE_TIME_PHRASINGS if terse else [])


def weather_phrasings(split: str) -> list[str]:
    return COPY_WEATHER_PHRASINGS + _EXTRA["weather"] if split == "copy" else WEATHER_PHRASINGS


def time_phrasings(split: str) -> list[str]:
    return COPY_TIME_PHRASINGS + _EXTRA["time"] if split == "copy" else TIME_PHRASINGS


WIDE_TOPIC_COUNT = 1500
_WIDE_TOPICS: list[str] = []


def wide_topics(seed: int = COPY_NAME_SEED + 3, n: int = WIDE_TOPIC_COUNT) -> list[str]:
    """``n`` made-up search topics: one to three lowercase words of the prose (seeded), none
    holding an evaluation value. With a few dozen fixed topics the model learns the topics,
    not the request: "Look up <unseen topic>" became a weather call on the spelt opener."""
    words = _prose_words()
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        topic = " ".join(rng.sample(words, rng.choice((1, 2, 2, 3))))
        if not any(v in topic for v in _EVAL_VALUES):
            out[topic] = None
    return list(out)


def use_wide_topics(on: bool) -> None:
    """Search requests of the training splits draw from ``wide_topics()`` as well as the fixed
    training topics (call before the first chat is made)."""
    _WIDE_TOPICS[:] = wide_topics() if on else []


def _topics(split: str) -> list[str]:
    return F.EVAL_TOPICS if split == "eval" else F.TRAIN_TOPICS + _WIDE_TOPICS


def t_weather(rng: random.Random, split: str) -> ToolTask:
    cities = _cities(split)
    if rng.random() < 0.15:
        c1, c2 = rng.sample(cities, 2)
        p = rng.choice(["Compare the weather in {a} and {b}.", "What's the weather in {a} and in {b}?"]).format(a=c1, b=c2)
        res = [{"city": c, "temperature_c": rng.randint(-10, 35), "condition": rng.choice(F.CONDITIONS)} for c in (c1, c2)]
        ans = " ".join(f"In {r['city']} it is {r['condition']} with {r['temperature_c']}°C." for r in res)
        return p, [("get_weather", {"city": c1}), ("get_weather", {"city": c2})], res, ans
    c = rng.choice(cities)
    p = rng.choice(weather_phrasings(split)).format(c=c)
    t, cond = rng.randint(-10, 35), rng.choice(F.CONDITIONS)
    res = {"city": c, "temperature_c": t, "condition": cond}
    return p, [("get_weather", {"city": c})], [res], f"The weather in {c} is {cond} with a temperature of {t}°C."


def t_time(rng: random.Random, split: str) -> ToolTask:
    c = rng.choice(_cities(split))
    p = rng.choice(time_phrasings(split)).format(c=c)
    tm = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    return p, [("get_time", {"city": c})], [{"city": c, "time": tm}], f"The current time in {c} is {tm}."


def t_add(rng: random.Random, split: str) -> ToolTask:
    lo, hi = (1000, 9999) if split == "eval" else (100, 999)   # eval uses 4-digit numbers only
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    p = rng.choice(["Use the add tool to add {a} and {b}.", "Please add {a} and {b} with the calculator.",
                    "Calculate {a} + {b} using a tool.", "Call add on {a} and {b}."]).format(a=a, b=b)
    return p, [("add", {"a": a, "b": b})], [{"result": a + b}], f"The sum of {a} and {b} is {a + b}."


def t_search(rng: random.Random, split: str) -> ToolTask:
    q = rng.choice(_topics(split))
    p = rng.choice(["Search the web for {q}.", "Look up {q} for me.", "Find information about {q}.",
                    "Can you search for {q}?"]).format(q=q)
    res = {"title": f"{q.capitalize()} - overview", "snippet": f"A short introduction to {q}."}
    return p, [("search", {"query": q})], [res], f"I found a page titled \"{res['title']}\": {res['snippet']}"


def t_convert(rng: random.Random, split: str) -> ToolTask:
    (u1, u2), f = rng.choice(list(F.UNITS.items()))
    v = rng.randint(51, 99) if split == "eval" else rng.randint(1, 50)
    p = rng.choice(["Use the converter to turn {v} {u1} into {u2}.", "Convert {v} {u1} to {u2} with the unit tool.",
                    "Call the unit converter: {v} {u1} in {u2}."]).format(v=v, u1=u1, u2=u2)
    return (p, [("convert_units", {"value": v, "from_unit": u1, "to_unit": u2})], [{"value": v * f, "unit": u2}],
            f"{v} {u1} is {v * f} {u2}.")


TOOL_KINDS: list[tuple[Callable[[random.Random, str], ToolTask], float]] = [
    (t_weather, 2.0), (t_time, 1.0), (t_add, 1.0), (t_search, 1.0), (t_convert, 1.0),
]

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant.", "Answer briefly and correctly."]


def _pick(rng: random.Random, table: list[tuple[Callable, float]]) -> Callable:
    return rng.choices([f for f, _ in table], weights=[w for _, w in table])[0]


def _accept(prompt: str, split: str) -> bool:
    return is_heldout(prompt) == (split == "eval")


def make_qa(rng: random.Random, split: str, thinking: bool, with_tools: bool) -> Chat:
    while True:
        p, a, think, avoid = _pick(rng, QUESTION_KINDS)(rng, split)
        if _accept(p, split):
            break
    content = a if not thinking else a
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        msg["reasoning_content"] = think
    tools = tool_list(rng, None, exclude={avoid} if avoid else set()) if with_tools else None
    return Chat(messages=[{"role": "user", "content": p}, msg], tools=tools, thinking=thinking,
                kind="qa", meta={"answer": a})


def make_tool_chat(rng: random.Random, split: str,
                   kinds: list[tuple[Callable[[random.Random, str], ToolTask], float]] = TOOL_KINDS) -> Chat:
    """User request -> tool call(s) -> tool result(s) -> final answer."""
    while True:
        task = _pick(rng, kinds)
        p, calls, results, final = task(rng, split)
        if _accept(p, split):
            break
    tools = tool_list(rng, calls[0][0])
    call_msgs = [{"type": "function", "function": {"name": n, "arguments": json.dumps(args, ensure_ascii=False)}}
                 for n, args in calls]
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": p},
        {"role": "assistant", "content": "", "tool_calls": call_msgs},
    ]
    for r in results:
        msgs.append({"role": "tool", "content": json.dumps(r, ensure_ascii=False)})
    msgs.append({"role": "assistant", "content": final})
    return Chat(messages=msgs, tools=tools, kind="tool", expect_tool=calls[0][0], expect_args=calls[0][1])


def make_chat(rng: random.Random, split: str = "train") -> Chat:
    """One training chat: mix of direct answers, thinking, tool use, system prompts, history."""
    r = rng.random()
    if r < 0.35:
        chat = make_tool_chat(rng, split)
    else:
        chat = make_qa(rng, split, thinking=rng.random() < 0.45, with_tools=rng.random() < 0.25)
    if rng.random() < 0.15:                      # an earlier exchange as history
        prev = make_qa(rng, split, thinking=False, with_tools=False)
        chat.messages = prev.messages + chat.messages
    if rng.random() < 0.3:
        chat.messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + chat.messages
    return chat


CITY_KINDS: list[tuple[Callable[[random.Random, str], ToolTask], float]] = [(t_weather, 2.0), (t_time, 1.0)]
COPY_CITY_SHARE = 0.3        # copy-stage chats that are a weather / time request (on top of make_chat's own)


def make_copy_chat(rng: random.Random, city_share: float = COPY_CITY_SHARE) -> Chat:
    """One copy-stage chat: the usual mix, over the large city pool and the extra phrasings,
    with ``city_share`` of them extra weather / time requests."""
    if rng.random() < city_share:
        chat = make_tool_chat(rng, "copy", CITY_KINDS)
        if rng.random() < 0.3:
            chat.messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + chat.messages
        return chat
    return make_chat(rng, "copy")


def copy_drill(rng: random.Random) -> str:
    """A plain-text copying drill (trained on every token): name lists said twice, and short
    requests each followed by the JSON arguments that copy their city. Only the copy can
    predict the second mention, which is the signal that teaches the model to look back."""
    pool = copy_city_pool()
    lines: list[str] = []
    lists = rng.random() < 0.4               # a drill is all name lists or all requests
    for _ in range(rng.randint(3, 6)):
        if lists:
            names = rng.sample(pool, rng.randint(2, 6))
            lines.append(f"Names: {', '.join(names)}.\nAgain: {', '.join(names)}.")
        else:
            items = []
            for _ in range(rng.randint(2, 5)):
                c = rng.choice(pool)
                table = COPY_WEATHER_PHRASINGS if rng.random() < 0.6 else COPY_TIME_PHRASINGS
                p = rng.choice(table).format(c=c)
                if is_heldout(p):
                    continue
                items.append(f"{p} {json.dumps({'city': c}, ensure_ascii=False)}")
            lines.append("\n".join(items))
    return "\n\n".join(line for line in lines if line)


def copy_eval_prompts(seed: int, n: int) -> list[Chat]:
    """Held-out city requests: an evaluation city in a held-out phrasing (never trained), cities in turn."""
    rng = random.Random(seed)
    out: list[Chat] = []
    for i in range(n):
        c = F.EVAL_CITIES[i % len(F.EVAL_CITIES)]
        name = "get_weather" if rng.random() < 0.6 else "get_time"
        table = HELDOUT_WEATHER_PHRASINGS if name == "get_weather" else HELDOUT_TIME_PHRASINGS
        p = rng.choice(table).format(c=c)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": p}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        out.append(Chat(messages=msgs + [{"role": "assistant", "content": ""}], tools=tool_list(rng, name),
                        kind="copy", expect_tool=name, expect_args={"city": c}))
    return out


def eval_prompts(seed: int, n_chat: int, n_tool: int, n_think: int) -> dict[str, list[Chat]]:
    """Held-out prompt sets (prompts never emitted by the training split)."""
    rng = random.Random(seed)
    tool = [make_tool_chat(rng, "eval") for _ in range(n_tool)]
    think = [make_qa(rng, "eval", thinking=True, with_tools=rng.random() < 0.25) for _ in range(n_think)]
    plain = [make_qa(rng, "eval", thinking=False, with_tools=rng.random() < 0.25) for _ in range(n_chat)]
    return {"tool": tool, "think": think, "plain": plain}


# --------------------------------------------------------------------------------------
# Prose

def prose_documents(max_chars: int = 1200) -> list[str]:
    """Plain English from the stdlib's own documentation (``pydoc_data.topics``), in chunks."""
    from pydoc_data.topics import topics

    docs: list[str] = []
    for key in sorted(topics):
        paras = [p.strip() for p in topics[key].split("\n\n") if p.strip()]
        buf = ""
        for para in paras:
            para = " ".join(line.strip() for line in para.splitlines()) if not para.startswith("   ") else para
            if buf and len(buf) + len(para) > max_chars:
                docs.append(buf)
                buf = ""
            buf = f"{buf}\n\n{para}" if buf else para
        if buf:
            docs.append(buf)
    return docs
