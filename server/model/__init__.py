"""DeepSeek-V3 model, MTP layer and checkpoint loading (see docs/interfaces.md)."""
