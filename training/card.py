"""The model card (README.md) of the bundled demo model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import corpus
from .evaluate import EvalResult
from .spec import TrainSettings, set_args as spec_set_args


def write_card(out: Path, s: TrainSettings, cfg: dict[str, Any], res: EvalResult, train_info: dict[str, Any]) -> None:
    n_params = train_info.get("parameters", 0)
    hist = train_info.get("history", [])
    last = hist[-1] if hist else {}
    pre = [h for h in hist if h.get("stage") == "pretrain"]
    last1 = pre[-1] if pre else {}
    stage_s = train_info.get("stage_seconds", [0.0, 0.0])
    runs = train_info.get("sft_runs", [])
    cmds = [".venv/bin/python -m training --out /tmp/demo-run1"
             + ("" if not runs or runs[0]["steps"] == s.sft_steps else f" --sft-steps {runs[0]['steps']}")
             + "   # corpus, tokenizer, stage 1, first SFT run, evaluation"]
    chained = [r for r in runs[1:] if not r.get("refresh")]      # a refresh run is part of the one command
    for i, r in enumerate(chained, 2):
        dest = "models/deepseek-v3-tiny-mtp" if i == len(chained) + 1 else f"/tmp/demo-run{i}"
        cmds.append(f".venv/bin/python -m training --stage2-from /tmp/demo-run{i - 1} --out {dest} "
                    f"--sft-steps {r['steps']} --sft-lr {r['lr']:g}   # SFT run {i} from the previous result")
    if not chained:
        total_min = train_info.get("total_seconds", 0) / 60
        base = TrainSettings()
        opts = ("" if s.copy_pretrain == base.copy_pretrain else
                (" --copy-pretrain" if s.copy_pretrain else " --no-copy-pretrain"))
        opts += "" if s.sft_arg_weight == base.sft_arg_weight else f" --sft-arg-weight {s.sft_arg_weight:g}"
        opts += "" if s.threads == base.threads else f" --threads {s.threads}"
        opts += "".join(f" --set {k}={v}" for k, v in spec_set_args(s, base,
                                                                    skip=("copy_pretrain", "sft_arg_weight", "threads")))
        cmds[0] = (f".venv/bin/python -m training{opts}   # corpus, tokenizer, all stages, "
                   f"evaluation; writes this folder (~{total_min:.0f} min, {s.threads} thread"
                   f"{'s' if s.threads > 1 else ''})")
    copy = train_info.get("copy_run")
    if copy:
        total_min = train_info.get("total_seconds", 0) / 60
        full_min = (sum(train_info.get("stage_seconds", [])) + train_info.get("total_seconds", 0)
                    - copy.get("seconds", 0)) / 60
        # stage 3 runs at copy_threads whatever --threads says, so the thread count is left out
        sets = "".join(f" --set {k}={v}" for k, v in spec_set_args(s, TrainSettings(), skip=("copy_steps", "threads")))
        cmds = [f".venv/bin/python -m training --copy-steps {copy['steps']}{sets}"
                "   # corpus, tokenizer, stages 1-3, evaluation; "
                f"writes this folder (~{full_min:.0f} min on 2 cores)"]
        if train_info.get("stage3_from"):
            cmds.append("# this folder was written by the stage-3 shortcut, from the stage-2 result of the same "
                        "command (the previous\n# committed model, model.safetensors sha256 "
                        f"{train_info.get('stage3_base_sha256', '?')[:16]}...; ~{total_min:.0f} min):\n"
                        f".venv/bin/python -m training --stage3-from STAGE2_FOLDER --copy-steps {copy['steps']}{sets}")
    reproduce = "\n".join(cmds)
    arg_text = (f"; the tokens of every tool-call argument value (and the quote closing it) weigh "
                f"{s.sft_arg_weight:g}x in the loss" if s.sft_arg_weight != 1.0 else "")
    sft_text = ", then ".join(
        f"{r['steps']} steps at peak lr {r['lr']:g} ({r['warmup_steps']} warm-up, seed {r['seed']}, {r['seconds'] / 60:.1f} min)"
        + ("" if i == 0 else " continuing from the previous result with a fresh optimizer")
        + (f" on the corpus rebuilt with its search requests over {corpus.WIDE_TOPIC_COUNT} more made-up topics "
           "(`corpus.wide_topics`, stage 2b: with a few dozen fixed topics the model took a search for an unseen "
           "topic for a weather request on the request's spelt first word)" if r.get("wide_topics") else "")
        for i, r in enumerate(runs)) + f", each cosine to {s.min_lr_ratio} x peak" + arg_text
    distill = train_info.get("sft_distill", 0.0)
    distill_text = (
        f"The SFT loss adds {distill:g} x KL(main || MTP): at each MTP position i, the MTP layer's "
        "distribution for token i+2 is pulled towards the main model's own (detached) distribution "
        "at position i+1, which predicts the same token. A draft is accepted when it agrees with the "
        "main model, not with the corpus, so this self-distillation (as EAGLE and Medusa-2 train "
        "their drafters) is the signal acceptance needs." if distill else "")
    copy_text = ""
    piece_text = polish_text = ""
    if copy and copy.get("polish_steps"):
        polish_text = (f"\n   Then {copy['polish_steps']} steps on {copy['polish_chats']} new copy chats and the prose, no drills, "
                       f"at peak lr {copy['polish_lr']:g}, the copy heads still supervised (the drills, trained on every "
                       "token, otherwise leak into answers and thinking).")
    if copy and copy.get("piece_names"):
        piece_text = (f"; {copy['piece_names']} of the pool's names are spelt from the vocabulary's own pieces "
                      "(`corpus.piece_names`: a capitalised piece and one to three lowercase ones, each lowercase "
                      "piece dealt about equally often), so that every piece a name may need has been copied")
    if copy and copy.get("append_layers"):
        copy_text = _appended_layers_text(copy, cfg, last, piece_text, s.min_lr_ratio)
    elif copy:
        copy_text = f"""
3. copy stage, from the stage-2 weights with a fresh optimizer and the stage-3 tokenizer rule (a space
   before a capital letter is a token of its own, so a name is the same token sequence in the prompt,
   the tool call and the tool result; same vocabulary): {copy['chats']} new chats (corpus seed
   {copy['corpus_seed']}), the stage-2 mix plus {copy.get('city_share', corpus.COPY_CITY_SHARE):.0%} more weather / time requests, over a pool of
   {len(corpus.copy_city_pool())} city names (the training cities, other real ones, made-up ones from syllables,
   capitalised words and vocabulary pieces; never an evaluation city) and {len(corpus.COPY_WEATHER_PHRASINGS)} weather /
   {len(corpus.COPY_TIME_PHRASINGS)} time phrasings, plus the prose and {copy.get('drills', 0)} copying drills
   (name lists said twice, requests followed by their JSON arguments){piece_text}; copy heads
   (`training/copy_heads.py`): head 0 of layer {copy.get('prev_layer')} is supervised to attend
   to the previous token, head 0 of layers {', '.join(map(str, copy.get('copy_layers', [])))}{" and of the MTP layer" if copy.get('mtp_supervision') else ""}
   to an earlier occurrence of the name piece to be written next (weight {copy.get('supervision', 0):g}), and
   those heads' value/output path starts from a least-squares fit that reads the piece back through
   `lm_head` ({copy.get('value_init', 0):g} x the residual's size) and is trained to keep doing so
   (weight {copy.get('value_weight', 0):g}); loss on what the
   assistant writes as in stage 2, the tokens of every tool-call argument value (and the quote closing it)
   weighted {copy['arg_weight']:g}x ({train_info.get('copy_targets', 0)} target tokens, {copy['rows']} rows):
   {copy['steps']} steps at peak lr {copy['lr']:g} ({copy['warmup_steps']} warm-up, seed {copy['seed']},
   {copy['seconds'] / 60:.1f} min), cosine to {s.min_lr_ratio} x peak, KL weight {copy['mtp_distill']:g}
   (final losses main {last.get('main', float('nan')):.3f}, MTP {last.get('mtp', float('nan')):.3f}, weighted).{polish_text}
"""
    sft_last = [h for h in hist if str(h.get("stage", "")).startswith("sft")]
    last2 = sft_last[-1] if sft_last else last
    copy_eval_text = ""
    if "tool_city_copy" in res.figures:
        copy_eval_text = (
            f" `tool_city_copy`: {res.counts.get('n_copy', 0)} weather / time requests naming one of the 20 held-out "
            "cities in one of 10 held-out phrasings (neither ever trained, e.g. `What is the weather in Florence?`); "
            'share whose first call is the right function with arguments exactly `{"city": <that city>}`.')
    cpu = train_info.get("cpu", "CPU")
    pool_text = drill_text = ""
    if s.copy_pretrain:
        spelt = ("; and it spells every capitalised word one letter a token (`render.SPELL_NAMES`), so an unseen "
                 "name is a run of letters seen millions of times, and copying it means finding the right letter, "
                 "never reading back a rare piece" if s.spell_names else "")
        pool_text = f"""
  - so that a call can only get its city right by copying it from the request: the weather / time
    chats (about 40% of all: {corpus.COPY_CITY_SHARE:.0%} of the chats are extra weather / time requests on top of the usual mix)
    draw their cities from a pool of {len(corpus.copy_city_pool())} names (the training cities, other real ones,
    made-up ones from syllables and capitalised English words; never an evaluation city) and their
    requests from {len(corpus.weather_phrasings("copy"))} weather / {len(corpus.time_phrasings("copy"))} time phrasings
    (never the held-out ones); the tokenizer splits the space before a capital letter into a token of
    its own, so a name is the same token sequence in the request, the call, the tool result and the answer{spelt}."""
        drill_text = (f" and {s.pretrain_drills} copying drills (`corpus.copy_drill`: name lists said twice, "
                      "requests each followed by the JSON arguments that copy their city"
                      + ("" if s.sft_drills else "; stage 1 only") + ")")
    text = f"""# deepseek-v3-tiny-mtp

A tiny model with the DeepSeek-V3 architecture and a trained Multi-Token Prediction (MTP) layer.
It is the daemon's built-in default model, so a fresh clone can serve it with MTP speculative
decoding without downloading anything. It knows only its synthetic training world: a few dozen
countries, chemical elements, small sums, unit conversions, word tasks and five demo tools.

Produced by `python -m training` (the recipe in training/): it builds the corpus, trains the tokenizer
and the model (the daemon's own `server.model.DeepseekV3ForCausalLM`, main model and MTP layer
together), writes this folder and runs the evaluation.

## Architecture

| | |
|---|---|
| layout | DeepSeek-V3 (`model_type: deepseek_v3`, `DeepseekV3ForCausalLM`), float32 |
| main layers | {cfg['num_hidden_layers']} (layer 0 dense MLP, layers 1-{cfg['num_hidden_layers'] - 1} MoE) |
| MTP layers | {cfg['num_nextn_predict_layers']} (`model.layers.{cfg['num_hidden_layers']}`: enorm, hnorm, eh_proj, one MLA + MoE block, shared_head) |
| hidden size | {cfg['hidden_size']} |
| attention | MLA, {cfg['num_attention_heads']} heads, q_lora_rank {cfg['q_lora_rank']}, kv_lora_rank {cfg['kv_lora_rank']}, qk_nope {cfg['qk_nope_head_dim']}, qk_rope {cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}, RoPE theta {cfg['rope_theta']:g} |
| MoE | {cfg['n_routed_experts']} routed experts (top-{cfg['num_experts_per_tok']}, sigmoid scores, `noaux_tc` with a zero correction bias, n_group {cfg['n_group']}), {cfg['n_shared_experts']} shared expert, expert width {cfg['moe_intermediate_size']}, dense width {cfg['intermediate_size']} |
| vocabulary | {cfg['vocab_size']} (byte-level BPE with DeepSeek's special tokens{"; a space before a capital letter is split off into its own token" if copy or s.copy_pretrain else ""}{"; capitalised words spelt one letter a token" if s.spell_names else ""}) |
| context | {cfg['max_position_embeddings']} positions (trained on rows of {s.seq_len}) |
| parameters | {n_params / 1e6:.2f} M unique (the MTP layer's embed_tokens / shared_head.head are copies of the main ones, as in the official release) |

Loads with the daemon's `server.model.load_checkpoint` (main model + MTP layer) and with
`transformers`' `DeepseekV3ForCausalLM` (which ignores the MTP layer); their logits agree
(tests/demo/test_demo_model.py).

## Corpus (built offline by the script, fixed seeds)

- {s.num_chats} synthetic chats rendered with the project's chat template
  (`server/text/templates/deepseek_v3.jinja`, also in `tokenizer_config.json`):
  - questions and answers: capitals, continents and languages of 30 countries, symbols and atomic numbers
    of 25 elements, sums / differences / products of small numbers, unit conversions,
    letter counting, spelling, first letters, repetition, small talk;
  - about 45% of the question chats with thinking on: `<think>\\n` reasoning `</think>` then the answer;
  - about 35% tool chats in the DeepSeek-V3 tool-call format: `get_weather(city)`, `get_time(city)`,
    `add(a, b)`, `search(query)`, `convert_units(value, from_unit, to_unit)` (1-3 tools offered
    per chat), the call, the tool result, and a final answer; some with two parallel calls;
  - some chats with a system prompt, with tools offered but not needed, or with an earlier exchange;{pool_text}
- Plain English prose: Python's own documentation text (`pydoc_data.topics`, stdlib){drill_text}, ~{train_info.get('prose_tokens', 0) // 1000}k tokens.
- Held-out split: every prompt naming an evaluation-only city, word or search topic, or whose CRC32
  falls in 1 of 10 buckets, is never trained on; evaluation prompts come only from that side
  (and tool sums use 4-digit numbers, conversions values 51-99, which training never uses).
- {train_info.get('rows', 0)} packed rows of {s.seq_len} tokens, {train_info.get('train_tokens', 0) / 1e6:.2f} M training tokens in all.

## Training

{"Three" if copy else "Two"} stages in one run, all training the main model and the MTP layer jointly with
loss = main next-token CE + {s.mtp_weight} x MTP CE (the MTP layer predicts token i+2 from the main
model's final-norm hidden state at i and the embedding of token i+1; its head is tied to `lm_head`
while training, as DeepSeek-V3 shares it):

1. pre-training on every token of the packed corpus: {s.steps} steps of {s.batch_size} x {s.seq_len} tokens,
   peak lr {s.lr}, {s.warmup_steps} warm-up steps, cosine to {s.min_lr_ratio} x peak
   ({stage_s[0] / 60:.1f} min; final losses main {last1.get('main', float('nan')):.3f}, MTP {last1.get('mtp', float('nan')):.3f});
2. supervised fine-tuning from those weights with a fresh optimizer, the loss restricted to what the
   assistant writes (answers, reasoning after the template's `<think>\\n`, tool calls, final answers after
   tool results; {train_info.get('sft_targets', 0)} target tokens in the packed rows) plus the prose:
   {sft_text}
   (final losses on those targets main {last2.get('main', float('nan')):.3f}, MTP {last2.get('mtp', float('nan')):.3f}).
   {distill_text}{copy_text}

AdamW (betas 0.9/0.95, weight decay {s.weight_decay} on matrices), grad clip {s.grad_clip}, {s.threads} CPU
thread{"s" if s.threads > 1 else ""}{f" ({s.copy_threads} in stage 3)" if copy and s.copy_threads != s.threads else ""}, seeds: model and data order {s.seed} (stage 2: {s.seed + 2}), corpus {s.corpus_seed},
evaluation {s.eval_seed}; `torch.use_deterministic_algorithms(True)`. Training took
{train_info.get('train_seconds', 0) / 60:.1f} minutes ({train_info.get('total_seconds', 0) / 60:.1f} minutes for the whole script,
corpus and evaluation included) on a shared 2-core CPU machine ({cpu}). The full per-20-step loss
history is in `training_log.json`.

## Evaluation (held-out prompts, greedy)

```
{res.table()}
```

{res.counts['n_plain']} plain, {res.counts['n_think']} thinking and {res.counts['n_tool']} tool prompts; acceptance over
{res.counts['drafted']} drafted positions. `mtp_acceptance_k1`: share of generated positions where the MTP
layer's greedy draft equals the main model's greedy token (k=1). `tool_call_ok`: output parses as a
DeepSeek-V3 tool call to the right function with the schema's keys as JSON. `thinking_ok`: closed
`<think>` block followed by an answer.{copy_eval_text} The `*_exact` rows compare with the reference answer
(facts the model cannot compute, e.g. sums, lower them); they have no target.

## Reproduce

```
{reproduce}
.venv/bin/python -m training --eval-only   # evaluation of the committed model (~{res.seconds / 60:.0f} min; {res.counts.get('n_tool', 0)} prompts a set, {res.counts.get('n_copy', 0)} copy prompts)
```

Re-running the training reproduces the figures within noise (same seeds; floating-point
reductions on a different CPU can change the last bits).

## Limits

A demonstration artefact, not a useful assistant: it answers only questions shaped like its
training chats, invents facts outside its tables, and cannot do arithmetic beyond what it
memorised. Prompts longer than {cfg['max_position_embeddings']} tokens are out of range.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def _appended_layers_text(copy: dict, cfg: dict, last: dict, piece_text: str, min_lr_ratio: float) -> str:
    """Stage 3 as copy_layers.py ran it, in the words of the run's own settings (copy_run)."""
    n_new = 1 + copy["append_layers"]
    n2 = cfg["num_hidden_layers"] - n_new
    nan = float("nan")
    mlp = ("the new layers' MLPs start silent (output projections zero) and train as well"
           if copy.get("train_mlp") else "the new layers' MLPs stay zero")
    if copy.get("mtp_train"):
        mtp = (f"the MTP layer, its own head included, trains at peak lr {copy['mtp_lr']:g}: distilled from the new "
               f"main model (weight {copy.get('mtp_distill', 0):g}, as in stage 2), its head 0 supervised to attend "
               "where the copy heads do")
        mtp_loss = ""
        mtp_final = f"MTP distillation {last.get('mtp_distill', nan):.3f}"
    else:
        mtp = "the MTP layer keeps the stage-2 weights and head"
        mtp_loss = f" and of the MTP logits (weight {copy.get('mtp_retain', 0):g})"
        mtp_final = f"MTP retention {last.get('mtp_retain', nan):.3f}"
    mixed = (" Only the prompt, the tool results and the argument values are encoded with this rule; what the "
             "assistant writes outside the values keeps stage 2's pieces (`train.encode_mixed`), so the frozen "
             "layers see their own tokens there." if copy.get("mixed_tokens") else "")
    chat = (f", cross-entropy of the chats' other assistant tokens (weight {copy['chat_ce']:g})"
            if copy.get("chat_ce") else "")
    return f"""
3. copy stage (`training/copy_layers.py`): the stage-2 model stays as it is, frozen, and
   {n_new} decoder layers of the same kind are appended after its {n2} (layers {n2}-{n2 + n_new - 1}; the MTP layer
   moves to index {n2 + n_new}). Heads 0-1 of layer {n2} are supervised to attend to the previous token; heads 0-1
   of layers {n2 + 1}-{n2 + n_new - 1} to an earlier occurrence of the tool-argument piece to be written next, and
   to the document's BOS everywhere else (weight {copy.get('sink_weight', 0):g}). `lm_head` trains too (a piece
   read back through the stage-2 head is told from the others poorly); {mlp}; {mtp}.
   Tokenizer rule of this stage: a space before a capital letter is a token of its own, so a name is the
   same token sequence in the prompt, the call and the result (same vocabulary).{mixed} Data: {copy['chats']} new
   chats (corpus seed {copy['corpus_seed']}), the stage-2 mix plus {copy.get('city_share', corpus.COPY_CITY_SHARE):.0%} more weather / time requests over a pool of
   {len(corpus.copy_city_pool())} city names (never an evaluation city){piece_text}, and {copy.get('prose_docs', 0)}
   prose documents; {copy['rows']} rows. Loss: cross-entropy of the tool-argument values (and the quote closing
   them, weight {copy['arg_weight']:g}){chat}, KL to the stage-2 model of the main logits (weight
   {copy.get('retain', 0):g}) at every other position{mtp_loss}, the attention terms (weight
   {copy.get('supervision', 0):g}) and a readout term (what the copy heads would write at a name piece reads back as
   that piece, weight {copy.get('value_weight', 0):g}). {copy['steps']} steps at peak lr {copy['lr']:g}
   ({copy['warmup_steps']} warm-up, {copy['seconds'] / 60:.1f} min), cosine to {min_lr_ratio} x peak (final:
   argument values {last.get('args', nan):.3f}, retention {last.get('retain', nan):.3f}, {mtp_final}).
"""
