"""Text handling: tokenizer, chat template, incremental detokenizer, reasoning and tool-call parsing."""
