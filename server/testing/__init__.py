"""Factories for tests and demos: tiny checkpoints and tokenizers."""
