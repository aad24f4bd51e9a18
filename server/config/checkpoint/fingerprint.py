"""A checkpoint's fingerprint: what names its weights' content, wherever it lies.  No torch.

KV rows mean something only for the weights that computed them.  A PD prefill instance
(P) and a decode instance (D) on different checkpoints of the same shape (a rolling
upgrade, a wrong ``modelWeightPath``) exchanged rows that D loaded as its own: wrong
answers with HTTP 200, and a prefix cache that stayed wrong.  The transfer layout now
carries this fingerprint (server/pd/instance.py), the coordinator pairs only instances
that agree, and D refuses rows of another one.

The fingerprint is content, not a path: the same checkpoint mounted at two paths on two
machines agrees, and new weights copied over old ones at the same path do not.  It reads
``config.json`` (and a quantized checkpoint's description), and of every
``*.safetensors`` file its name, size and header (every tensor's name, dtype, shape and
offsets) and the first ``SAMPLE_BYTES`` of every tensor's data.  Two trainings of one
shape differ in the first values of every tensor they trained; reading a sample instead
of every byte keeps the cost at one small read per tensor (the demo model: 2 ms; a
DeepSeek-V3 checkpoint: about 90,000 reads of 256 bytes, once at start).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

SAMPLE_BYTES = 256
MAX_HEADER_BYTES = 100 << 20          # safetensors' own bound on its JSON header


def weights_fingerprint(weights: str | os.PathLike[str]) -> str:
    """16 hex digits naming the checkpoint in ``weights`` (a folder) by its content.
    OSError or ValueError when a weight file cannot be read."""
    folder = Path(weights)
    h = hashlib.blake2b(b"mtp-serve weights v1", digest_size=8)
    described = sorted(p.name for p in folder.glob("quant_model_description*.json"))
    for name in ("config.json", *described):
        path = folder / name
        if path.is_file():
            h.update(b"\0file\0" + name.encode() + b"\0" + path.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        h.update(b"\0tensors\0" + path.name.encode())
        _tensor_file(path, h)
    return h.hexdigest()


def _tensor_file(path: Path, h: "hashlib._Hash") -> None:
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        raw = os.pread(fd, 8, 0)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header size)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: safetensors header of {n} bytes")
        header = os.pread(fd, n, 8)
        h.update(struct.pack("<QQ", size, n) + header)
        tensors = json.loads(header)
        if not isinstance(tensors, dict):
            raise ValueError(f"{path}: the safetensors header is not a JSON object")
        try:
            starts = sorted({int(t["data_offsets"][0]) for k, t in tensors.items()
                             if k != "__metadata__"})
        except (KeyError, TypeError, IndexError, ValueError):
            raise ValueError(f"{path}: a tensor in the safetensors header has no "
                             "data_offsets") from None
        for start in starts:
            h.update(os.pread(fd, SAMPLE_BYTES, 8 + n + start))
