"""MTP serving daemon for DeepSeek-V3/R1-style models."""
