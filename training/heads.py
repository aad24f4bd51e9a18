"""Where the demo model's attention heads look: a diagnostic for copying (issue 18 item 8).

A model can copy a name from the prompt only with a previous-token head (attends to the
position before it) feeding an induction head in a later layer (attends to the position
after the current token's earlier occurrence).  This prints, per layer and head, the mean
attention weight at offset -1 on a text, and at the induction target on a random id
sequence said twice; a copying model shows a head near 1 in each.

    .venv/bin/python -m training.heads [MODEL_DIR]
"""
from __future__ import annotations

import contextlib
import random
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def recorded_attention(model):
    """Yields a list that receives each layer's attention weights [nH, L, L] (batch row 0)
    during ``model.forward_full``."""
    probs: list[torch.Tensor] = []
    cls = type(model.model.layers[0].self_attn)
    plain = cls._attend_decompressed

    def attend(self, q_nope, q_pe, latent, k_pe, mask=None, is_causal=False):
        k_nope, _v = self._expand(latent)
        s = latent.shape[1]
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, s, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        probs.append(scores.softmax(-1)[0])
        return plain(self, q_nope, q_pe, latent, k_pe, mask, is_causal)

    cls._attend_decompressed = attend
    try:
        yield probs
    finally:
        cls._attend_decompressed = plain


def head_profile(model, text_ids: list[int], vocab_size: int, seed: int = 0) -> list[dict[str, list[float]]]:
    """Per layer: {"prev": [per head], "induction": [per head]} mean attention weights."""
    n = 30
    seq = [random.Random(seed).randrange(20, vocab_size) for _ in range(n)]
    with torch.no_grad(), recorded_attention(model) as probs:
        model.forward_full(torch.tensor([text_ids]))
        on_text = list(probs)
        probs.clear()
        model.forward_full(torch.tensor([[0] + seq + seq]))
        on_repeat = list(probs)
    out = []
    for p_text, p_rep in zip(on_text, on_repeat):
        length = p_text.shape[1]
        prev = torch.stack([p_text[:, i, i - 1] for i in range(1, length)], 1).mean(1)
        # query 1 + n + j (second saying of seq[j]) should look at 2 + j (what followed seq[j])
        ind = torch.stack([p_rep[:, 1 + n + j, 2 + j] for j in range(n - 1)], 1).mean(1)
        out.append({"prev": prev.tolist(), "induction": ind.tolist()})
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tokenizers import Tokenizer

    from server.model.loading import load_checkpoint

    ap = argparse.ArgumentParser(prog="python -m training.heads", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, nargs="?", default=ROOT / "models" / "deepseek-v3-tiny-mtp")
    folder = ap.parse_args(argv).model_dir
    model, _info = load_checkpoint(folder, dtype=torch.float32)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode((ROOT / "README.md").read_text()[:3000]).ids[:300]
    for i, row in enumerate(head_profile(model, ids, model.config.vocab_size)):
        print(f"layer {i}: previous-token " + " ".join(f"{v:.2f}" for v in row["prev"])
              + " | induction " + " ".join(f"{v:.2f}" for v in row["induction"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
