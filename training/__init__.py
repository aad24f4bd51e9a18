"""The recipe of the bundled demo model (models/deepseek-v3-tiny-mtp) and the tool that
makes its int8 variants; run from the repository root, not installed with ``server``.

    python -m training [--eval-only] ...        the corpus, tokenizer, training stages, evaluation, card
    python -m training.quantize SRC DST ...     an int8 checkpoint (msModelSlim or compressed-tensors)
    python -m training.heads [MODEL_DIR]        where the attention heads look (a copying diagnostic)

Modules: spec (settings, config), facts and corpus (the synthetic world and its chats),
render (chat text, tokenizer), train (the training loop and its losses), copy_heads and
copy_layers (stage 3: copying a name from the prompt), evaluate, export, card.
"""
