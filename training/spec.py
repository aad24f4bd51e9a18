"""Architecture and training settings of the bundled demo model (one place, written to the card)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from server.text import special_tokens as st


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 1234                 # model init, data order
    corpus_seed: int = 20240501      # synthetic chats (training split)
    eval_seed: int = 777             # held-out prompts (evaluation split)
    num_chats: int = 24000
    prose_repeats: int = 1
    vocab_size: int = 2048
    seq_len: int = 384
    batch_size: int = 8
    steps: int = 1100
    lr: float = 2.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 80
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    mtp_distill: float = 0.0         # weight of KL(main || MTP) (see train.losses); the SFT stage sets its own
    # Copying from stage 1 on (issue 18 item 8; --copy-pretrain): the tokenizer is trained with the
    # name-splitting rule (render.NAME_SPLIT) from the start, the chats are corpus.make_copy_chat's
    # (weather / time requests over the 6,585-name city pool, more phrasings; never an evaluation
    # city or a held-out phrasing), the prose carries pretrain_drills copying drills (corpus.copy_drill),
    # and stage 2 trains on the same rows with tool-argument values weighted sft_arg_weight.
    # On by default since spell_names made it work (run E below is the committed model); before
    # that it did not teach copying. Runs without spelt names (1 thread, 1.3-1.5 s/step, eval-n 30,
    # copy-eval-n 40):
    #   pilot, --copy-pretrain --steps 350 --sft-steps 250 --sft-arg-weight 4 (822 s training):
    #     copy 0.00, acceptance 0.830, tool format 0.567, thinking 0.00, plain 0.267 (undertrained)
    #   full, --copy-pretrain --sft-arg-weight 4 (1100 + 1300 steps, 1557 + 1988 s, 15.1 MB):
    #     copy 0.00, acceptance 0.887, tool format 0.933, thinking 1.00, plain 0.933, tool args exact 0.00
    #   from scratch, 300 steps of drills only at a constant lr 3e-3 (scratch script, no chats):
    #     no copying either (NLL of a name's second mention in a "Names: ... Again: ..." list 4.0 nats)
    # In the full run's model a name's second mention, in a list or in the JSON arguments, still
    # costs 3.5-12 nats a piece (its first letter ~3.5, i.e. a guess among the capitals): no
    # induction head formed in 1100 + 1300 steps of 8 x 384 tokens; the calls hold invented names.
    copy_pretrain: bool = True
    # Names spelt one letter a piece (render.SPELL_NAMES) in the tokenizer trained in stage 1,
    # and, with copy_heads_from_start, copy heads supervised to the same letter of an earlier
    # mention of the same name (copy_aligned; copy_heads.aligned_copy_targets).
    # Runs (1 thread, eval-n 20, copy-eval-n 40; base: --copy-pretrain --sft-arg-weight 4 --set
    # spell_names=1, 1100 + 1300 steps, ~27 + 33 min, 15.1 MB):
    #   A base:                                   copy 0.725, acceptance 0.911, tool 0.90, thinking 1.00, plain 0.75
    #   B + copy_heads_from_start, copy_aligned:  copy 0.550, acceptance 0.911, tool 0.65, thinking 0.90, plain 0.80
    #   C + composed_phrasings, pretrain_drills 0: copy 0.500, acceptance 0.927, tool 0.75, thinking 0.95, plain 1.00
    #   E + sft_drills 0 (stage 1 = A's):        copy 0.825, acceptance 0.942, tool 1.00, thinking 1.00, plain 1.00
    #   F E + terse_phrasings:                    copy 0.625, acceptance 0.910, tool 0.80, thinking 0.90, plain 1.00
    # E is stages 1 and 2 of the committed model (these defaults; 1805 + 2253 s, 1 thread; stage 2b below
    # follows). At eval-n 60 it scores tool 0.933: its 4 misses are search requests over held-out topics
    # taken for weather requests on the spelt opener, hence stage 2b. E's copy misses are the function,
    # not the name: "Time in X?" -> get_weather.
    # Spelt names are what made copying work (every earlier recipe: copy 0.00 from stage 1 on):
    # teacher-forced, A reads 271 of 274 held-out city letters right (37 of 40 whole names). A's
    # 11 free-run misses: 8 pick the wrong function on a held-out phrasing ("Time in X?",
    # "Look up the local time for X." -> get_weather), 3 misspell (Salzurg). Its plain and
    # tool misses write drill text ("Names: ..."), hence sft_drills. C: with a thousand composed
    # phrasings each one is rare, time requests go to get_weather more often, and without the
    # drills names are misspelt (Nagoaa, Calgarar).
    spell_names: bool = True
    copy_aligned: bool = False
    composed_phrasings: bool = False   # with copy_pretrain: corpus.use_extra_phrasings(composed=True)
    terse_phrasings: bool = False      # with copy_pretrain: corpus.use_extra_phrasings(terse=True)
    wide_topics: bool = False        # search requests over corpus.wide_topics() too, not only the fixed topics
    sft_drills: bool = False         # True: the stage-1 drills stay among stage 2's documents (they leak into answers)
    copy_heads_from_start: bool = False   # with copy_pretrain: the copy_* heads supervised in stages 1 and 2
    pretrain_drills: int = 4000
    drill_seed: int = 20240777       # the stage-1 drills
    sft_arg_weight: float = 4.0      # tool-argument values weigh this much in stage 2's loss
    # Stage 2 (SFT): loss only on what the assistant writes (plus prose), from the stage-1 weights.
    sft_steps: int = 1300
    sft_lr: float = 1.5e-3
    sft_warmup_steps: int = 20
    sft_mtp_distill: float = 3.0
    # Stage 2b (refresh; skipped when wide_topics is already on): a second SFT run from the stage-2
    # weights, fresh optimizer, on the corpus rebuilt with wide_topics. With the spelt names the
    # stage-2 model took "Look up <unseen topic>" / "Search the web for <unseen topic>" for a
    # weather request on the spelt opener (get_weather {"city": "Lookjen"}, {"city": "Search"}):
    # its 4 tool-format misses of 60, all search requests over the held-out topics. Runs from the
    # stage-2 result (--stage2-from, --set wide_topics=1; eval-n 60, copy-eval-n 80, 1 thread):
    #   no refresh (stage 2 alone): acceptance 0.927, tool 0.933, thinking 0.967, plain 0.967, copy 0.838
    #   300 steps at 5e-4:          acceptance 0.935, tool 0.967, thinking 0.967, plain 1.000, copy 0.825
    #   500 steps at 5e-4:          acceptance 0.926, tool 1.000, thinking 0.950, plain 1.000, copy 0.838
    # 300 keeps every floor with a prompt to spare (500 leaves thinking at its floor).
    refresh_steps: int = 300
    refresh_lr: float = 5.0e-4
    # Stage 3 (copy; issue 18 item 8), from the stage-2 weights: the name-splitting pre-tokenizer
    # (render.with_name_split, same vocabulary), chats over a large city pool (corpus.make_copy_chat,
    # with corpus.piece_names: names spelt from every lowercase piece of the vocabulary), copying
    # drills, tool-argument values weighted copy_arg_weight, and copy heads (copy_heads.py): head 0
    # of layer copy_prev_layer supervised to look one token back, head 0 of each copy_layers layer
    # (and of the MTP layer) supervised to look at an earlier occurrence of the name piece it must
    # write, their value/output path started from a least-squares fit (copy_value_init x the
    # residual's size) and trained to read back as that piece (copy_value_weight).
    # What did not work before (LM loss alone; 1 thread, eval-n 30, copy-eval-n 40):
    #   200-700 steps from stage 2 with drills at lr 1e-3..3e-3: copy 0.00-0.30, and thinking fell to
    #   0.50-0.60 whenever copy rose; copying from stage 1 on (copy_pretrain, 1100 + 1300 steps): copy
    #   0.00. The model's attention stayed near uniform (heads.py: no previous-token head, <= 0.14 at
    #   offset -1; no induction head, <= 0.06), i.e. no circuit to copy with. With attention
    #   supervision alone the heads attend right in 200 steps but write made-up names (the piece's
    #   identity through a 32-wide value path is learnt slowly); the value fit fixes that, and the
    #   piece names cover the pieces (gen, burg, ago) the other names never used.
    # Runs of this recipe from the committed stage-2 weights (--stage3-from, --copy-steps 600,
    # 2 threads, eval-n 30, copy-eval-n 40; ~13 min of stage 3a + 5 min of 3b):
    #   no sink, no stage 3b:       copy 0.525, acceptance 0.809, tool format 0.833, thinking 0.333, plain 0.733
    #   these settings (sink 0.5, 3b 250 steps): copy 0.525, acceptance 0.822, tool format 0.800,
    #                                            thinking 0.367, plain 0.767
    # The copy heads work: on the 20 held-out cities in held-out phrasings they put 0.98-0.99 of
    # their weight on the right prompt piece (teacher-forced, mean NLL of a city piece 0.36, from
    # 2.1 without the value fit); the misses are rare pieces (gen, burg, now, ence) still read back
    # wrong. What fails is the rest: thinking and answers loop ("w-n-n-n", "So the answer is So the
    # answer is"), i.e. the repurposed heads (head 0 of layers 2-5) still fire outside names and the
    # stage-2 skills are not relearnt in 850 steps. Hence OFF BY DEFAULT (copy_steps 0: the default
    # command still builds the committed model).
    # Second round (same base and evaluation; --set FIELD=VALUE for the new fields, no stage 3b):
    #   r1 400 steps, no drills, copy_retain 1 (KL to the frozen stage-2 model off the argument
    #      values), copy_args_only:               copy 0.025, acceptance 0.670, tool 0.833, thinking 0.333, plain 0.567
    #   r2 + the value map blind to BOS (resting heads write 0.00 of a name's size there, from 1.33)
    #      and copy_value_silence 1, every name a target: copy 0.050, acceptance 0.779, tool 0.833, thinking 0.733, plain 0.967
    #   r3 r2 with copy_args_only:                copy 0.050, acceptance 0.795, tool 0.800, thinking 0.400, plain 0.467
    #   r4-r7 only the circuit's head-0 slices training, the rest frozen (gradient masks; removed
    #      since), 4000 drills, sink 1, lr 1.5e-3 and 6e-3, with and without an attention-first phase
    #      (heads' output zeroed) and trainable rotary keys in the previous-token layer: the circuit
    #      does not form (previous-token NLL 1.4-3.9, copy NLL 2.0-3.5 after 350 steps, vs 0.01 and
    #      0.4 with the whole model training), and what the heads write breaks the rest (r7, 6e-3:
    #      copy 0.000, acceptance 0.652, tool 0.567, thinking 0.033).
    # What this says: the retention KL stays at 0.4-0.8 nats a token whatever the weight path, and
    # silencing r2's copy heads does not bring its thinking back (8 -> 9 of 12 prompts), so it is the
    # rest of the model that drifts: trained whole, it re-routes names through the new heads and
    # loses the stage-2 route (the thinking line "the language of <country>" fails at the country).
    # Frozen, it keeps its skills but head 0 alone cannot become the circuit (the rotary key and the
    # kv latent are shared by all heads).
    # From stage 1 on (--copy-pretrain --sft-arg-weight 4 --set copy_heads_from_start=1, the copy
    # heads supervised in both stages, no stage 3; 1222 s + 1726 s on 2 threads): copy 0.150,
    # acceptance 0.855, tool format 0.833, thinking 0.967, plain 0.933, tool args exact 0.333. The
    # other skills grow around the circuit (thinking kept), the heads attend right (copy NLL 0.18,
    # sink 0.14 at the end) but the value readout is still 0.70 nats and calls write "Obencia" for
    # Valencia. A stage 3 on top of it (--copy-pretrain --stage3-from that run --copy-steps 300
    # --copy-drills 0, copy_value_init 0, copy_retain 1, no 3b; 554 s): retention KL only
    # 0.04-0.07 nats, but copy 0.075, acceptance 0.864, tool 0.767, thinking 0.933, plain 1.000
    # (the value readout rose from 1.23 to 1.58 nats on the piece-name chats). Next to try on this path: the value fit before stage 2 (from the stage-1 latents),
    # piece names in the corpus (needs the tokenizer first: a two-pass corpus), more SFT steps.
    # Appended copy layers (copy_layers.py; copy_append_layers > 0): the stage-2 model frozen, a
    # previous-token layer and copy_append_layers copy layers appended, lm_head trained, the MTP
    # head kept; no drills, copy_prose_docs prose documents for the retention terms. Pilot runs
    # from the committed stage-2 model (3000 chats, 300 prose docs, 2202 rows, the stage-2 output
    # computed once; eval-n 5, copy-eval-n 20, so coarse):
    #   1 copy layer, no previous-token layer, frozen head, 300 steps: argument CE 7.0 -> 4.6, copy 0.00
    #   + the previous-token layer, 400 steps: attention right (copy NLL 0.45) but argument CE 4.4, the
    #     readout (what the copy heads write, read through the frozen head) 1.8 nats; copy 0.00
    #   3 copy layers, 800 steps at 5e-3: readout 1.7, argument CE 2.7, copy 0.10, thinking 0.60
    #   2 copy layers, lm_head training too, retention 2, sink 1, 800 steps: readout 0.40, argument CE
    #     1.1, copy 0.40, acceptance 0.772, tool 1.00, thinking 1.00 (the MTP head was still tied to
    #     lm_head and fed the new hidden states: hence the untied head and the MTP retention term)
    #   the same with the untied head and the MTP retention, 1200 steps: copy 0.45, acceptance 0.802
    # Through this script (--stage3-from the committed model --copy-steps 1200 --copy-lr 5e-3
    # --copy-chats 3000 --copy-drills 0 --set copy_append_layers=2 --set copy_retain=2 --set
    # copy_sink_weight=1 --set copy_prose_docs=300 --set polish_steps=0; 1316 s, 19.0 MB, 11 layers;
    # eval-n 10, copy-eval-n 40): copy 0.350, acceptance 0.786, tool format 1.00, thinking 1.00,
    # plain 0.90, tool args exact 0.50 (0.00 before). The other skills hold; what is short: on about
    # 30% of the held-out requests the frozen stage-2 model picks no call or the wrong function
    # ("Time in Bergen?", "What time is it now in Nagoya?" -> get_weather), which this stage cannot
    # change (retention KL on every token but the argument values); some pieces are read back wrong
    # (Valencia -> "Valpaia", Halifax -> "Halific"); the MTP layer drafts the copied pieces badly.
    # Next tried, same base and command (1 thread each, two runs side by side, --eval-n 20
    # --copy-eval-n 40; copy_chat_ce: CE on the chats' other assistant tokens next to the KL;
    # copy_mtp_train: the MTP layer trains at copy_mtp_lr, distilled from the new main model, its
    # head 0 supervised as a copy head):
    #   A chat_ce 1, retain 2, mtp_train, 1200 steps, 3000 chats:        copy 0.475, acceptance 0.782, tool 1.00, thinking 0.55
    #   B chat_ce 2, retain 1, mtp_train (lr 2e-3), same:                copy 0.475, acceptance 0.812, tool 0.90, thinking 0.85
    #   C chat_ce 0.5, retain 2, mtp_train, 1500 steps, 10000 chats:      copy 0.525, acceptance 0.820, tool 1.00, thinking 0.75
    #   D as C with the MTP layer frozen (mtp_retain 1):                  copy 0.575, acceptance 0.708, tool 1.00, thinking 0.65
    # So training the MTP layer is worth ~0.11 of acceptance (C vs D); the chat CE fixes some of the
    # function choices (A: 7 of 40 held-out requests pick no call or the wrong function, from ~12)
    # but not "Time in <city>?" (-> get_weather); the copies still misread a piece or miss where a
    # name ends (Valencia -> "Valpia", Adelaide -> "Adelaidede", Gdansk -> "Gdansket"). Thinking
    # loops where a name is due ("The capital of  The capital of ...", "Spained"): the copy heads
    # were only ever supervised on argument values, so elsewhere what they do is untrained.
    #   E as C with copy_all_names (targets on every repeated name piece): copy 0.575, acceptance 0.823, tool 1.00, thinking 0.40
    #   F as E with retain 4:                                             copy 0.525, acceptance 0.824, tool 1.00, thinking 0.70
    # Supervising the heads on every name did not stop the loops, and a stronger retention KL only
    # partly: with the stage-2 layers frozen, thinking is lost in free generation (exposure to the
    # new layers' small teacher-forced deviations, KL 0.08-0.14 a token). Still open: function
    # choice on held-out phrasings ("Time in <city>?") is the frozen trunk's; acceptance 0.82.
    # Why thinking broke: the name-split rule also re-tokenized the assistant's own text, so stage 3
    # taught the model to write a bare "Ġ" before every capitalised word (stage 2 writes "ĠIreland"),
    # a state the frozen layers never saw and where their reference is garbage ("The capital of
    # Ġ" -> "The", the loop). The committed model with the split rule on its prompts alone keeps
    # thinking 1.00 and acceptance 0.921 (eval-n 20). copy_mixed_tokens encodes what the assistant
    # writes with stage 2's pieces and only the context and the argument values name-split:
    #   G as C with copy_mixed_tokens:               copy 0.525, acceptance 0.837, tool 1.00, thinking 0.95, plain 0.95
    #   H as G with chat_ce 1:                       copy 0.525, acceptance 0.813, tool 1.00, thinking 1.00, plain 0.80
    # Thinking is back; what fails now is mostly the pieces after the first (Florence -> "Florend",
    # Salzburg -> "Salzeazea", Sapporo -> "Sanb": 15 of G's 19 misses), and 4 calls of the wrong
    # function or none ("Time in Calgary?").
    # Longer (3000 steps), the MTP layer at copy_mtp_lr 2e-3, otherwise as G (3177 s / 3545 s of stage 3):
    #   I copy_value_weight 2 (19.0 MB):             copy 0.600, acceptance 0.872, tool 1.00, thinking 1.00, plain 0.90
    #   J copy_append_layers 3 (20.2 MB):            copy 0.600, acceptance 0.900, tool 1.00, thinking 0.90, plain 0.90
    # I meets the acceptance, tool and thinking floors; copy is short of 0.8. Of I's 16 misses, 11
    # misread the pieces after the first, always of the same cities (Florence -> "Florage",
    # Valencia -> "Valfia", Salzburg, Nagoya, Sapporo, Lucknow, Bergen: rare pieces read back
    # wrong), and 5 short held-out requests ("Time in Bergen?") get no call.
    # A probe of I (teacher-forced calls) shows the copy heads attending to the right piece of the
    # request at weight ~1.00 even where the piece is misread: the readout fails, not the lookup,
    # and only for pieces the data seldom copies ("gen", "ago", "burg", "enc": 3-10 times as a
    # city piece in the 10,000 chats; "r", "e": ~210). The new layers' MLPs, frozen at zero, left
    # the readout one linear path through a 64-wide latent:
    #   K as I with copy_train_mlp (3165 s):         copy 0.700, acceptance 0.907, tool 0.90, thinking 1.00, plain 0.90
    # K's misses: 10 of 12 are the same rare pieces misread, 1 no call ("Time in Calgary?");
    # tool: "search for solar eclipses" -> get_time, one search query left unclosed.
    # More copying of exactly those pieces: 20,000 chats, copy_piece_name_count 18000 and
    # copy_city_share 0.7 put "gen", "ago", "burg" in 20-30 city calls each (3-10 before):
    #   M as K with that data (17,232 rows, 3896 s): copy 0.725, acceptance 0.902, tool 1.00, thinking 1.00, plain 0.85
    # Yet the probe of M still finds the heads on the right piece and "gen", "burg", "ago" read back
    # at p 0.00-0.04: not rarity alone. And the heavier weather / time share moved the frozen
    # trunk's function choice: 6 of M's 11 misses are "Time in <city>?" answered with get_weather.
    #   N as M with copy_city_share 0.5, copy_chat_ce 1 (15,291 rows): copy 0.675, acceptance 0.890, tool 0.95, thinking 0.90, plain 0.95
    # No run meets copy >= 0.8; the committed model stays the stage-2 one (copy_steps 0).
    copy_append_layers: int = 0
    copy_mtp_retain: float = 1.0     # KL of the MTP layer's logits to stage 2's (copy_layers.py; MTP frozen)
    copy_chat_ce: float = 0.0        # CE on the chats' other assistant tokens (function names), next to the KL
    copy_mtp_train: bool = False     # the MTP layer trains: self-distillation (copy_mtp_distill) + a copy head
    copy_mtp_lr: float = 1.0e-3
    copy_all_names: bool = False     # the copy heads' targets: every repeated name piece, not only argument values
    copy_prose_docs: int = 0         # 0: all of them
    copy_train_mlp: bool = False     # the appended layers' MLPs train too (they start silent: down_proj 0)
    copy_mixed_tokens: bool = False  # the assistant's own text in stage 2's pieces, but for argument values (train.encode_mixed)
    copy_threads: int = 1            # stage 3's torch threads (its runs used 1; the thread count moves the last bits)
    copy_steps: int = 0                 # 600 in the runs above; 0: no stage 3
    copy_lr: float = 1.5e-3
    copy_warmup_steps: int = 20
    copy_chats: int = 10000
    copy_corpus_seed: int = 20240601
    copy_arg_weight: float = 6.0
    copy_drills: int = 4000          # plain-text copying drills (corpus.copy_drill) among the stage-3 documents
    copy_piece_names: bool = True
    copy_piece_name_count: int = 6000  # corpus.piece_names in the pool (each lowercase piece in about n/600 of them)
    copy_city_share: float = 0.3     # copy chats that are an extra weather / time request (corpus.make_copy_chat)
    copy_prev_layer: int = 1
    copy_layers: tuple[int, ...] = (2, 3, 4, 5)
    copy_mtp_supervision: bool = True
    copy_supervision: float = 1.0    # weight of the attention terms
    copy_value_weight: float = 1.0
    copy_value_init: float = 1.0
    copy_sink_weight: float = 0.5    # elsewhere the copy heads rest on the document's BOS (copy_heads.py)
    copy_fit_rows: int = 300
    copy_value_silence: float = 0.0  # the value fit also silences the heads at rest (copy_heads.fit_copy_values)
    copy_args_only: bool = False     # copy targets only in tool-argument values (copy_heads.CopySupervision)
    copy_retain: float = 0.0         # KL to the frozen stage-2 model off the argument values (train.losses)
    # Stage 3b: the drills are trained on every token, and 600 steps of them at copy_lr leave the
    # model writing drill text into answers and breaking its thinking; a short pass on new copy
    # chats alone, at a low rate and with the copy heads still supervised, brings that back.
    polish_steps: int = 250
    polish_lr: float = 5.0e-4
    polish_warmup_steps: int = 10
    polish_chats: int = 6000
    copy_mtp_distill: float = 3.0
    stage: str = ""
    threads: int = 1                  # the committed model was built at 1 thread (the thread count moves the last bits)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def set_args(s: TrainSettings, base: TrainSettings, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(field, value) for each field of ``s`` that differs from ``base`` (not in ``skip``), written
    as ``with_overrides`` reads it back: the ``--set`` part of a command that reproduces ``s``."""
    out = []
    for f in dataclasses.fields(s):
        v, b = getattr(s, f.name), getattr(base, f.name)
        if f.name in skip or v == b or f.name == "stage":
            continue
        text = ("1" if v else "0") if isinstance(v, bool) else ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
        out.append((f.name, text))
    return out


def with_overrides(s: TrainSettings, assignments: list[str]) -> TrainSettings:
    """``s`` with ``FIELD=VALUE`` assignments applied, each value parsed as its field's type
    (bool: 1/0/true/false; tuple of ints: 2,3,4 or empty)."""
    fields = {f.name: f for f in dataclasses.fields(s)}
    changes: dict[str, Any] = {}
    for a in assignments:
        name, sep, raw = a.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set {a!r}: expected FIELD=VALUE with FIELD one of TrainSettings' fields")
        kind = type(getattr(s, name))
        try:
            if kind is bool:
                if raw.lower() not in ("1", "0", "true", "false"):
                    raise ValueError(raw)
                value: Any = raw.lower() in ("1", "true")
            elif kind is tuple:
                value = tuple(int(v) for v in raw.split(",") if v.strip())
            else:
                value = kind(raw)
        except ValueError:
            raise ValueError(f"--set {a!r}: {raw!r} is not a {kind.__name__}") from None
        changes[name] = value
    return dataclasses.replace(s, **changes)


def hf_config(vocab_size: int, bos_id: int, eos_id: int, max_len: int = 1024) -> dict[str, Any]:
    """config.json of the demo model: DeepSeek-V3 layout, scaled down."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def generation_config(bos_id: int, eos_id: int) -> dict[str, Any]:
    return {"_from_model_config": True, "bos_token_id": bos_id, "eos_token_id": eos_id,
            "do_sample": True, "temperature": 0.6, "top_p": 0.95}


SPECIALS = {"bos": st.BOS, "eos": st.EOS, "pad": st.PAD}
