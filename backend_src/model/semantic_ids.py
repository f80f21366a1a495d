"""Semantic IDs: every item gets L codes (L - 1 residual k-means levels + 1 collision code; L = 4
by default), and a vectorized table of valid prefixes so constrained decoding only ever emits
items that exist.

Item embeddings come from text where the data has it (TF-IDF + truncated SVD), otherwise from
collaborative signal (windowed item co-occurrence, PPMI, truncated SVD), plus attribute one-hots
where available.
"""
from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from backend_src.data.sequences import training_events
from backend_src.model.kmeans import kmeans
from backend_src.model.rq_vae import rq_vae_codes

NUM_LEVELS = 4  # the default length: 3 k-means levels + 1 collision code
# residual k-means (the recipe); a learned residual quantizer; the same also pulled toward the items'
# co-occurrence embeddings (rq_vae.py)
QUANTIZERS = ("kmeans", "rq-vae", "rq-vae-collaborative")


# --------------------------------------------------------------------------------------------
# Residual k-means
# --------------------------------------------------------------------------------------------
def residual_kmeans(
    x: torch.Tensor, sizes=(256, 256, 256), iters: int = 25, seed: int = 0, balanced: bool = False,
    return_centers: bool = False,
):
    """Residual quantization: level l clusters the residual x - sum_{m<l} center_m(x).

    x [I, D] -> codes [I, len(sizes)] (level l codes lie in 0..min(sizes[l], I)-1); balanced: each
    level's codes hold at most ceil(I / size) items each. return_centers: (codes, [each level's
    centers [C_l, D]]), the quantizer an item the codes were not fit on is placed with.
    """
    residual = x.float().clone()
    codes, levels = [], []
    for level, size in enumerate(sizes):
        assign, centers = kmeans(residual, size, iters=iters, seed=seed + level, balanced=balanced)
        codes.append(assign)
        levels.append(centers)
        residual = residual - centers[assign]
    codes = torch.stack(codes, dim=1)
    return (codes, levels) if return_centers else codes


def assign_collision_codes(codes3: torch.Tensor) -> torch.Tensor:
    """Append a last code = rank of the item among the items sharing its first codes.

    codes3 [I, L] -> codes [I, L+1], every row unique. Vectorized: lexicographic sort, then the
    position inside each run of equal keys.
    """
    codes3 = codes3.long()
    n = codes3.shape[0]
    if n == 0:
        return torch.zeros(0, codes3.shape[1] + 1, dtype=torch.long)
    # one int64 key per row (mixed radix); stable sort keeps item order inside a group
    radix = codes3.max(0).values + 1
    key = torch.zeros(n, dtype=torch.long)
    for level in range(codes3.shape[1]):
        key = key * radix[level] + codes3[:, level]
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    pos = torch.arange(n)
    new_group = torch.ones(n, dtype=torch.bool)
    new_group[1:] = sorted_key[1:] != sorted_key[:-1]
    group_start = torch.cummax(torch.where(new_group, pos, torch.zeros_like(pos)), 0).values
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = pos - group_start
    return torch.cat([codes3, rank[:, None]], dim=1)


# --------------------------------------------------------------------------------------------
# Item embeddings
# --------------------------------------------------------------------------------------------
def _truncated_svd(m: torch.Tensor, dim: int, seed: int = 0) -> torch.Tensor:
    """Rows of m (dense or sparse COO) -> U S [n, dim] (zero-padded when rank < dim)."""
    n, f = m.shape
    q = min(dim, n, f)
    out = torch.zeros(n, dim)
    if q == 0:
        return out
    torch.manual_seed(seed)  # svd_lowrank draws a random test matrix
    u, s, _ = torch.svd_lowrank(m, q=q, niter=4)
    out[:, :q] = u * s[None, :]
    return out


def _sparse(indices: torch.Tensor, values: torch.Tensor, shape) -> torch.Tensor:
    """Coalesced sparse COO matrix (duplicate entries summed)."""
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True).coalesce()


_WORD = re.compile(r"[a-z0-9]+")


def text_embeddings(texts: list[str], dim: int = 64, seed: int = 0) -> torch.Tensor:
    """TF-IDF over lower-cased words (L2-normalized rows) reduced by truncated SVD -> [n, dim]."""
    docs = [_WORD.findall((t or "").lower()) for t in texts]
    vocab: dict[str, int] = {}
    rows, cols, vals = [], [], []
    for r, words in enumerate(docs):
        for w, c in Counter(words).items():
            rows.append(r)
            cols.append(vocab.setdefault(w, len(vocab)))
            vals.append(c)
    n = len(texts)
    if not vocab:
        return torch.zeros(n, dim)
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    tf = torch.tensor(vals, dtype=torch.float32)
    df = torch.bincount(cols_t, minlength=len(vocab)).float()
    idf = torch.log((1.0 + n) / (1.0 + df)) + 1.0  # smoothed idf
    val = (1.0 + torch.log(tf)) * idf[cols_t]  # sublinear tf
    norm = torch.zeros(n).index_add_(0, rows_t, val * val).sqrt().clamp_min(1e-12)
    val = val / norm[rows_t]
    m = _sparse(torch.stack([rows_t, cols_t]), val, (n, len(vocab)))
    return _truncated_svd(m, dim, seed)


def collaborative_embeddings(
    offsets, items, num_items: int, dim: int = 64, window: int = 5, seed: int = 0
) -> torch.Tensor:
    """Item co-occurrence within `window` events of the same user, PPMI, truncated SVD.

    offsets [U+1], items [E]: users' events in CSR form (item indices 1..num_items).
    Returns [num_items, dim] for items 1..num_items (row i-1 = item i).
    """
    offsets = torch.as_tensor(np.asarray(offsets), dtype=torch.long)
    items = torch.as_tensor(np.asarray(items), dtype=torch.long) - 1  # 0-based
    e = items.numel()
    user = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1])
    src, dst = [], []
    for d in range(1, window + 1):  # loop over window offsets only
        if d >= e:
            break
        same = user[d:] == user[:-d]
        src.append(items[:-d][same])
        dst.append(items[d:][same])
    if not src or sum(s.numel() for s in src) == 0:
        return torch.zeros(num_items, dim)
    a, b = torch.cat(src), torch.cat(dst)
    a, b = torch.cat([a, b]), torch.cat([b, a])  # symmetric counts
    counts = _sparse(torch.stack([a, b]), torch.ones(a.numel()), (num_items, num_items))
    (ri, ci), c = counts.indices(), counts.values()
    row_sum = torch.zeros(num_items).index_add_(0, ri, c)
    total = c.sum()
    pmi = torch.log(c * total / (row_sum[ri] * row_sum[ci]))
    keep = pmi > 0
    ppmi = _sparse(torch.stack([ri[keep], ci[keep]]), pmi[keep], (num_items, num_items))
    return _truncated_svd(ppmi, dim, seed)


def attribute_features(item_attributes: dict, num_items: int, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Multi-hot attribute vectors (L2-normalized), reduced to `dim` columns by truncated SVD
    when there are more attributes than that. Returns [num_items, <=dim] for items 1..num_items."""
    rows, cols = [], []
    for item, attrs in item_attributes.items():
        if 1 <= int(item) <= num_items:
            for a in attrs:
                rows.append(int(item) - 1)
                cols.append(int(a))
    if not rows:
        return torch.zeros(num_items, 0)
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    _, cols_t = torch.unique(cols_t, return_inverse=True)  # compact attribute ids
    num_attr = int(cols_t.max()) + 1
    pairs = torch.unique(rows_t * num_attr + cols_t)  # multi-hot: each (item, attribute) once
    rows_t, cols_t = pairs // num_attr, pairs % num_attr
    deg = torch.bincount(rows_t, minlength=num_items).float().sqrt().clamp_min(1e-12)
    m = _sparse(torch.stack([rows_t, cols_t]), 1.0 / deg[rows_t], (num_items, num_attr))
    if num_attr <= dim:
        return m.to_dense()
    return _truncated_svd(m, dim, seed)


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def sequential_embeddings(data, end_offset: int = 2, dim: int = 64, epochs: int = 10, seed: int = 0,
                          max_len: int = 50, batch_size: int = 128) -> torch.Tensor:
    """The item table of a small SASRec trained for `epochs` on the training events (each user's
    events but the last end_offset; next item, softmax over all items): embeddings that carry
    which item follows which, not only which items co-occur. Returns [num_items, dim]."""
    from backend_src.data.sequences import length_bucketed, train_batches
    from backend_src.model.sasrec import SASRec, SASRecConfig

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = SASRec(SASRecConfig(num_items=int(data.num_items), hidden=dim, max_len=max_len, dropout=0.3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    model.train()
    for _ in range(epochs):
        batches = train_batches(data, batch_size * 16, max_len, rng=rng, end_offset=end_offset)
        for batch in length_bucketed(batches, batch_size, rng):
            loss = model.loss(batch.items, batch.targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.item_emb.weight.detach()[1:].clone()


# text: TF-IDF + SVD of the item text; text-encoder: the same text through a pretrained sentence encoder
# (text_encoder.py); collaborative: co-occurrence in the training events; sequential: the item table of a
# SASRec trained on the training events
ITEM_EMBEDDING_SOURCES = ("auto", "text", "text-encoder", "collaborative", "text+collaborative", "sequential")


def embedding_sources(data, sources: str = "auto") -> str:
    """`sources` with "auto" resolved: text where the data has item text, otherwise collaborative."""
    if sources not in ITEM_EMBEDDING_SOURCES:
        raise ValueError(f"sources must be one of {ITEM_EMBEDDING_SOURCES}, got {sources!r}")
    if sources == "auto":
        return "text" if getattr(data, "item_text", None) else "collaborative"
    return sources


def build_item_embeddings(
    data, dim: int = 64, window: int = 5, attribute_weight: float = 0.5, seed: int = 0, end_offset: int = 2,
    sources: str = "auto",
) -> torch.Tensor:
    """Item embeddings [I, D'] for items 1..I from `sources`: "auto" is text when data.item_text
    exists, otherwise collaborative; "text-encoder" is the item text through the pretrained
    sentence encoder instead of TF-IDF; "text+collaborative" puts both side by side, each unit-norm
    and weighted 1/sqrt(2) (what an item says and what it is bought with); attribute features
    (weighted) appended when data.item_attributes exists.

    `data` is any object with offsets, items, num_items, item_text, item_attributes. The
    collaborative embeddings count co-occurrences in training events only: each user's last
    end_offset events (2: the validation and test targets; 1: a refit's test target) are held
    out, and the item tokenizer must not have seen them.
    A tiny seeded jitter separates items with identical embeddings (e.g. items never seen
    together with others) so k-means does not pile them all into one collision group.
    """
    sources = embedding_sources(data, sources)
    num_items = int(data.num_items)
    item_text = getattr(data, "item_text", None)
    wanted = sources.split("+")
    if {"text", "text-encoder"} & set(wanted) and not item_text:
        raise ValueError(f"item embeddings from {sources!r}: this data set has no item text")
    texts = [item_text.get(i, "") or "" for i in range(1, num_items + 1)] if item_text else []
    parts = []
    if "text" in wanted:
        parts.append(_unit_rows(text_embeddings(texts, dim, seed)))
    if "text-encoder" in wanted:
        from backend_src.model.text_encoder import sentence_embeddings

        parts.append(_unit_rows(sentence_embeddings(texts)))
    if "collaborative" in wanted:
        offsets, items = training_events(data, end_offset)
        parts.append(_unit_rows(collaborative_embeddings(offsets, items, num_items, dim, window, seed)))
    if "sequential" in wanted:
        parts.append(_unit_rows(sequential_embeddings(data, end_offset, dim, seed=seed)))
    emb = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) / math.sqrt(len(parts))
    attrs = getattr(data, "item_attributes", None)
    if attrs:
        feats = _unit_rows(attribute_features(attrs, num_items, dim, seed))
        emb = torch.cat([emb, attribute_weight * feats], dim=1)
    gen = torch.Generator().manual_seed(seed)
    return emb + 1e-3 * torch.randn(emb.shape, generator=gen) / math.sqrt(emb.shape[1])


# --------------------------------------------------------------------------------------------
# Codebook with the valid-prefix table
# --------------------------------------------------------------------------------------------
class SemanticIdCodebook(nn.Module):
    """Codes of every item and the trie of valid prefixes as dense lookup tables.

    Buffers (saved with the checkpoint; shapes follow the loaded state):
      codes      [I+1, L]  codes of item i in row i; row 0 (padding) is all -1, never valid
      sizes      [L]       C_0..C_{L-1} (C_{L-1} = largest collision group)
      child_t    [P_t, C_t] (prefix id at level t, code) -> prefix id at level t+1, or -1;
                 level 0 has the single root prefix 0, P_L = I
      leaf_item  [P_L]     final prefix id -> item index
    """

    def __init__(self, codes: torch.Tensor | None = None, num_levels: int = NUM_LEVELS, centers: list | None = None,
                 content: torch.Tensor | None = None):
        """codes [I, L] of items 1..I (unique rows). None makes an empty placeholder of
        `num_levels` levels that a state dict loads into. centers: the residual k-means centers
        [C_t, E] of levels 0..L-2 the codes were fit with, and content [I, E] the item embeddings
        they were fit on (kept: the catalog places new items with them and compares them), or None."""
        super().__init__()
        if codes is None:
            codes = torch.zeros(0, num_levels, dtype=torch.long)
        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.dim() != 2 or codes.shape[1] < 2:
            raise ValueError(f"codes must be [num_items, L >= 2], got {tuple(codes.shape)}")
        if codes.numel() and codes.min() < 0:
            raise ValueError("codes must be >= 0")
        n, self.num_levels = codes.shape
        for t in range(self.num_levels - 1):
            self.register_buffer(f"center_{t}", torch.as_tensor(centers[t]).float() if centers else torch.zeros(0, 0))
        self.register_buffer("content", F.pad(torch.as_tensor(content).float(), (0, 0, 1, 0)) if content is not None
                             else torch.zeros(0, 0))  # row i: item i's; row 0 (padding) zero
        sizes = codes.max(0).values + 1 if n else torch.ones(self.num_levels, dtype=torch.long)
        self.register_buffer("codes", torch.cat([torch.full((1, self.num_levels), -1), codes]))
        self.register_buffer("sizes", sizes.clone())
        prefix = torch.zeros(n, dtype=torch.long)  # every item starts at the root
        num_prefixes = 1
        for t in range(self.num_levels):
            c = int(sizes[t])
            key = prefix * c + codes[:, t]
            uniq, inverse = torch.unique(key, return_inverse=True)  # ids in key order
            child = torch.full((num_prefixes, c), -1, dtype=torch.long)
            child[uniq // c, uniq % c] = torch.arange(uniq.numel())
            self.register_buffer(f"child_{t}", child)
            prefix, num_prefixes = inverse, uniq.numel()
        if num_prefixes != n:
            raise ValueError(f"semantic IDs are not unique: {n} items but {num_prefixes} distinct IDs")
        leaf = torch.zeros(num_prefixes, dtype=torch.long)
        leaf[prefix] = torch.arange(1, n + 1)
        self.register_buffer("leaf_item", leaf)
        self._build_decode_tables()

    def _build_decode_tables(self):
        """Derived (not saved) decoding tables of every level t:
          bias_t [P_t + 1, C_t]  0 where (prefix, code) continues an item, -inf where not; the
                                 extra last row, which prefix id -1 indexes, is all 0
          kids_t [P_t + 1, M_t]  the codes that continue each prefix, padded to the level's
                                 largest count M_t (pads and the dead row's entries are codes
                                 0..M_t-1), with kid_bias_t [P_t + 1, M_t] = 0 / -inf for pads;
                                 built only where M_t <= C_t / 2, else None (dense is cheaper)"""
        for t in range(self.num_levels):
            child = self.child(t)
            valid = child >= 0
            bias = torch.zeros(child.shape[0] + 1, child.shape[1], device=child.device)
            bias[:-1].masked_fill_(~valid, float("-inf"))
            self.register_buffer(f"bias_{t}", bias, persistent=False)
            width = int(valid.sum(1).max()) if child.numel() else 0
            kids = kid_bias = None
            if 0 < width <= child.shape[1] // 2:
                # valid codes first (ascending), then the rest: the first M_t columns hold them all
                kids = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
                pad = ~torch.gather(valid, 1, kids)
                dead = torch.arange(width, device=child.device)[None, :]
                kids = torch.cat([kids, dead])
                kid_bias = torch.zeros(kids.shape, device=child.device)
                kid_bias[:-1].masked_fill_(pad, float("-inf"))
            self.register_buffer(f"kids_{t}", kids, persistent=False)
            self.register_buffer(f"kid_bias_{t}", kid_bias, persistent=False)

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_codes(cls, codes: torch.Tensor) -> "SemanticIdCodebook":
        """codes [I, L] (items 1..I) or [I+1, L] with a padding row 0 of -1."""
        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.shape[0] and bool((codes[0] < 0).all()):
            codes = codes[1:]
        return cls(codes)

    @classmethod
    def build(
        cls, data, cfg=None, dim: int = 64, iters: int = 25, seed: int = 0, embeddings: torch.Tensor | None = None,
        end_offset: int = 2, sources: str = "auto", balanced: bool = False, quantizer: str = "kmeans", log=None,
    ) -> "SemanticIdCodebook":
        """Embeddings of the items of `data` (fit on each user's events but the last end_offset)
        -> L - 1 residual quantization levels (sizes from cfg.codebook_sizes[:-1], default 256 each
        for L = 4; `quantizer`: residual k-means, or the learned RQ-VAE of rq_vae.py, optionally
        aligned to the items' co-occurrence embeddings) -> collision code -> codebook."""
        if quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
        sizes = tuple(cfg.codebook_sizes[:-1]) if cfg is not None else (256,) * (NUM_LEVELS - 1)
        if embeddings is None:
            embeddings = build_item_embeddings(data, dim=dim, seed=seed, end_offset=end_offset, sources=sources)
        if quantizer.startswith("rq-vae"):
            if balanced:
                raise ValueError("balanced codes are a residual k-means option")
            aligned = None
            if quantizer == "rq-vae-collaborative":
                offsets, items = training_events(data, end_offset)
                aligned = collaborative_embeddings(offsets, items, int(data.num_items), dim, seed=seed)
            codes3, centers = rq_vae_codes(embeddings, sizes, seed=seed, aligned=aligned, log=log), None
        else:
            codes3, centers = residual_kmeans(embeddings, sizes, iters=iters, seed=seed, balanced=balanced, return_centers=True)
        return cls(assign_collision_codes(codes3), centers=centers, content=embeddings if centers else None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in [f"center_{t}" for t in range(self.num_levels - 1)] + ["content"]:  # kept since the catalog
            state_dict.setdefault(f"{prefix}{name}", torch.zeros(0, 0))
        # table shapes depend on the data: adopt the stored shapes before the normal copy
        for name in list(self._buffers):
            key = prefix + name
            if key in state_dict and state_dict[key].shape != self._buffers[name].shape:
                self._buffers[name] = torch.empty_like(state_dict[key], device=self._buffers[name].device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._build_decode_tables()

    # ---- placing an item the codes were not fit on -----------------------------------------
    @property
    def has_quantizer(self) -> bool:
        return all(self.get_buffer(f"center_{t}").numel() for t in range(self.num_levels - 1))

    def quantize(self, x: torch.Tensor, alternatives: int = 1) -> torch.Tensor:
        """Content embeddings x [n, E] (the space the codes were fit in) -> [n, alternatives, L - 1]
        codes: the nearest center per level of the residual left by the levels before, and in
        column a > 0 the same with the last level's (a+1)-th nearest center instead (where the
        nearest one's collision codes are all taken)."""
        residual = x.float()
        codes = []
        for t in range(self.num_levels - 1):
            centers = self.get_buffer(f"center_{t}")
            d = torch.cdist(residual, centers)
            if t < self.num_levels - 2:
                c = d.argmin(1)
                codes.append(c[:, None].expand(-1, alternatives))
                residual = residual - centers[c]
            else:
                codes.append(d.topk(min(alternatives, d.shape[1]), dim=1, largest=False).indices)
        k = codes[-1].shape[1]
        return torch.stack([c[:, :k] for c in codes], dim=-1)

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_items(self) -> int:
        return self.codes.shape[0] - 1

    @property
    def codebook_sizes(self) -> tuple:
        # read off the table shapes, not the `sizes` buffer: no device-to-host copy on a GPU
        # (which would also stop a decode from being captured into a CUDA graph)
        return tuple(self.child(t).shape[1] for t in range(self.num_levels))

    def child(self, level: int) -> torch.Tensor:
        return getattr(self, f"child_{level}")

    def prefix_counts(self) -> tuple:
        """P_1..P_L: how many distinct level-(t+1) prefixes there are, for t = 0..L-1 (P_L = items)."""
        return tuple(self.child(t).shape[0] for t in range(1, self.num_levels)) + (self.leaf_item.shape[0],)

    def next_prefixes(self, prefix_ids: torch.Tensor, level: int, codes: torch.Tensor | None = None) -> torch.Tensor:
        """Level-t prefix ids [...] -> the level-(t+1) prefix ids of codes [..., K], or of every
        code [..., C_t] when codes is None (-1 where a code continues no item or the prefix is dead)."""
        if codes is not None:
            return self.advance(prefix_ids[..., None].expand(codes.shape), codes, level)
        table = self.child(level)
        rows = table.index_select(0, prefix_ids.clamp_min(0).reshape(-1)).view(*prefix_ids.shape, table.shape[1])
        return torch.where(prefix_ids[..., None] >= 0, rows, -1)

    def valid_mask(self, prefix_ids: torch.Tensor, level: int) -> torch.Tensor:
        """prefix_ids [...] (level-t prefix ids, -1 = dead) -> bool [..., C_t]: codes that
        continue some existing item."""
        table = self.child(level)
        mask = table[prefix_ids.clamp_min(0)] >= 0
        return mask & (prefix_ids >= 0)[..., None]

    def code_bias(self, prefix_ids: torch.Tensor, level: int) -> torch.Tensor:
        """prefix_ids [...] -> float [..., C_t]: 0 for the codes that continue some existing
        item, -inf for the others; all 0 for dead prefixes (-1), whose beams already carry a
        -inf log-probability. Added to the logits, it constrains decoding with one gather."""
        table = getattr(self, f"bias_{level}")
        # a row gather (index_select) is several times faster on CPU than advanced indexing
        return F.embedding(prefix_ids % table.shape[0], table)  # -1 -> the last (all-0) row

    def continuations(self, prefix_ids: torch.Tensor, level: int):
        """prefix_ids [...] -> (codes [..., M_t], bias [..., M_t]): the codes that continue each
        prefix (padded, bias -inf on pads) when level t has a kids table, else (None, code_bias):
        all C_t codes. A beam step scores only these codes: log-softmax over them equals the
        log-softmax over all codes with the others at -inf, and the passes over [beams, codes]
        (log-softmax, beam scores, top-k) shrink from C_t to M_t columns."""
        kids = getattr(self, f"kids_{level}")
        if kids is None:
            return None, self.code_bias(prefix_ids, level)
        rows = prefix_ids % kids.shape[0]  # -1 -> the dead row
        return F.embedding(rows, kids), F.embedding(rows, getattr(self, f"kid_bias_{level}"))

    def kid_prefixes(self, level: int) -> torch.Tensor | None:
        """[P_t + 1, M_t]: the level-(t+1) prefix id each entry of the kids table makes (-1 for
        pads and the dead row), or None where level t has no kids table."""
        kids = getattr(self, f"kids_{level}")
        if kids is None:
            return None
        parents = torch.arange(kids.shape[0] - 1, device=kids.device)
        return F.pad(self.next_prefixes(parents, level, kids[:-1]), (0, 0, 0, 1), value=-1)

    def advance(self, prefix_ids: torch.Tensor, codes: torch.Tensor, level: int) -> torch.Tensor:
        """Level-t prefix ids and the next codes -> level-(t+1) prefix ids (-1 if invalid)."""
        table = self.child(level)
        ok = (prefix_ids >= 0) & (codes >= 0) & (codes < table.shape[1])
        flat = prefix_ids.clamp_min(0) * table.shape[1] + codes.clamp(0, table.shape[1] - 1)
        nxt = torch.take(table, flat)  # one flat gather: much cheaper than a 2-D index on CPU
        return torch.where(ok, nxt, -1)

    def items_of(self, final_prefix_ids: torch.Tensor) -> torch.Tensor:
        """Final (level-L) prefix ids -> item indices (0 for -1)."""
        items = self.leaf_item[final_prefix_ids.clamp_min(0)]
        return torch.where(final_prefix_ids >= 0, items, 0)

    def level_prefixes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [..., L] -> [..., L+1]: column t is the level-t prefix id that code t continues
        (column 0 the root, 0), column L the final prefix id (-1 from where the codes leave
        every item)."""
        p = [torch.zeros(codes.shape[:-1], dtype=torch.long, device=codes.device)]
        for t in range(self.num_levels):
            p.append(self.advance(p[-1], codes[..., t], t))
        return torch.stack(p, dim=-1)

    def prefix_of_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [..., L] -> final prefix ids (-1 where the codes are not an item)."""
        return self.level_prefixes(codes)[..., -1]

    def items_of_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [..., L] -> item indices (0 where the codes are not an item)."""
        return self.items_of(self.prefix_of_codes(codes))
