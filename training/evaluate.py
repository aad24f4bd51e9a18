"""Held-out evaluation of the demo model: MTP acceptance, tool calls, thinking.

Greedy generation runs the daemon's own model through its cache-free ``forward_full`` path
(outputs are short). Figures:

(a) acceptance: over greedy generations, the share of generated positions q (from the second
    generated token on) where the MTP layer's argmax at q-2 -- fed the main hidden h_{q-2}
    and token t_{q-1} -- equals t_q, the main model's greedy token. This is the per-draft
    acceptance rate of greedy MTP speculative decoding with k=1.
(b) tool prompts: share whose output parses (server.text's DeepSeekV3ToolParser) as a
    well-formed DeepSeek-V3 tool call naming the expected function, with JSON-object
    arguments holding exactly the schema's required keys, and ends with EOS.
(c) thinking prompts (prompt ends with ``<think>\\n``): share whose output closes the
    reasoning with ``</think>`` and then gives a non-empty answer, ending with EOS.
(d) city copy (``tool_city_copy``): weather / time requests naming a held-out city in a
    held-out phrasing (corpus.copy_eval_prompts: neither the city nor the phrasing is ever
    trained); share whose first call is the expected function with arguments exactly
    ``{"city": <the prompt's city>}``, ending with EOS.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from server.text import special_tokens as st
from server.text.reasoning import ReasoningParser
from server.text.tokenizer import Tokenizer
from server.text.tool_calls import DeepSeekV3ToolParser

from . import corpus, render

TARGETS = {"mtp_acceptance_k1": 0.85, "tool_call_ok": 0.95, "thinking_ok": 0.95, "tool_city_copy": 0.80}
# The floors a retrained demo model must keep (acceptance, tool format, thinking) and the one
# it must reach (copying the held-out city into the call, issue 18 item 8).


@torch.no_grad()
def greedy(model: DeepseekV3ForCausalLM, ids: list[int], eos: int, max_new: int) -> list[int]:
    """Greedy continuation (no cache: short outputs), stops after EOS."""
    seq = list(ids)
    out: list[int] = []
    for _ in range(max_new):
        h = model.forward_full(torch.tensor([seq]))[:, -1]
        nxt = int(model.compute_logits(h).argmax(-1))
        out.append(nxt)
        seq.append(nxt)
        if nxt == eos:
            break
    return out


@torch.no_grad()
def mtp_matches(model: DeepseekV3ForCausalLM, prompt: list[int], gen: list[int]) -> tuple[int, int]:
    """(accepted, drafted) for k=1 greedy MTP drafting over one finished generation."""
    seq = torch.tensor([prompt + gen])
    p = len(prompt)
    if len(gen) < 2:
        return 0, 0
    hidden = model.forward_full(seq)
    next_ids = torch.cat([seq[:, 1:], seq[:, -1:]], dim=1)
    h_mtp = model.mtp_forward_full(next_ids, hidden)
    # Draft for position q comes from MTP position q-2; q ranges over generated positions p+1..
    drafts = model.mtp_compute_logits(h_mtp[0, p - 1:len(prompt) + len(gen) - 2]).argmax(-1)
    target = seq[0, p + 1:]
    return int((drafts == target).sum()), int(target.numel())


@dataclass
class EvalResult:
    figures: dict[str, float]
    counts: dict[str, int]
    samples: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    def table(self) -> str:
        lines = ["| metric | value | target |", "|---|---|---|"]
        for k, v in self.figures.items():
            tgt = TARGETS.get(k)
            mark = "" if tgt is None else (f">= {tgt:.2f} " + ("PASS" if v >= tgt else "FAIL"))
            lines.append(f"| {k} | {v:.3f} | {mark} |")
        return "\n".join(lines)


def first_call(tool_parser: DeepSeekV3ToolParser, text: str) -> tuple[str | None, object]:
    """(name, parsed JSON arguments or None) of the first tool call in ``text``; (None, None) if none."""
    calls = tool_parser.extract(text).tool_calls
    if not calls:
        return None, None
    try:
        return calls[0].name, json.loads(calls[0].arguments)
    except ValueError:
        return calls[0].name, None


def evaluate(model: DeepseekV3ForCausalLM, model_dir: Path, seed: int, n_tool: int = 40, n_think: int = 40,
             n_plain: int = 40, n_copy: int = 40, log=print) -> EvalResult:
    t0 = time.time()
    tok = Tokenizer.from_dir(model_dir)
    eos = tok.token_to_id(st.EOS)
    sets = corpus.eval_prompts(seed, n_chat=n_plain, n_tool=n_tool, n_think=n_think)
    sets["copy"] = corpus.copy_eval_prompts(seed + 1, n_copy)
    tool_parser, reasoning = DeepSeekV3ToolParser(), ReasoningParser()
    acc = drafted = 0
    ok = {"tool": 0, "think": 0, "plain": 0, "copy": 0}
    exact = {"tool": 0, "think": 0, "plain": 0, "copy": 0}
    samples: dict[str, list[str]] = {k: [] for k in sets}
    for kind, chats in sets.items():
        for chat in chats:
            prompt_text = render.render_eval_prompt(chat)
            prompt = tok.encode(prompt_text)
            gen = greedy(model, prompt, eos, max_new=96)
            a, d = mtp_matches(model, prompt, gen)
            acc += a
            drafted += d
            finished = bool(gen) and gen[-1] == eos
            text = tok.decode(gen, skip_special_tokens=True)
            if len(samples[kind]) < 3:
                samples[kind].append(text)
            if kind == "tool":
                calls = tool_parser.extract(text).tool_calls
                good = False
                if finished and calls and calls[0].name == chat.expect_tool:
                    try:
                        args = json.loads(calls[0].arguments)
                    except ValueError:
                        args = None
                    required = corpus.TOOLS[chat.expect_tool]["function"]["parameters"]["required"]
                    good = isinstance(args, dict) and sorted(args) == sorted(required)
                    exact["tool"] += int(good and args == chat.expect_args)
                ok["tool"] += int(good)
            elif kind == "copy":
                name, args = first_call(tool_parser, text)
                ok["copy"] += int(finished and name == chat.expect_tool and args == chat.expect_args)
            elif kind == "think":
                reasoning_text, content = reasoning.extract(text)
                good = finished and st.THINK_END in text and bool(content and content.strip())
                ok["think"] += int(good)
                exact["think"] += int(good and content.strip() == chat.meta["answer"])
            else:
                good = finished and st.THINK_END not in text and bool(text.strip())
                ok["plain"] += int(good)
                exact["plain"] += int(text.strip() == chat.meta["answer"])
    n = {k: len(v) for k, v in sets.items()}
    figures = {
        "mtp_acceptance_k1": acc / max(1, drafted),
        "tool_call_ok": ok["tool"] / n["tool"],
        "thinking_ok": ok["think"] / n["think"],
        "plain_answer_ok": ok["plain"] / n["plain"],
        "tool_city_copy": ok["copy"] / max(1, n["copy"]),
        "tool_args_exact": exact["tool"] / n["tool"],
        "thinking_answer_exact": exact["think"] / n["think"],
        "plain_answer_exact": exact["plain"] / n["plain"],
    }
    res = EvalResult(figures=figures, counts={"drafted": drafted, "accepted": acc, **{f"n_{k}": v for k, v in n.items()}},
                     samples=samples, seconds=time.time() - t0)
    return res
