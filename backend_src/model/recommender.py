"""The assembled generative recommender: one HSTU backbone, a semantic-ID decoder (retrieval)
and an M-FALCON ranker, plus the item vocabulary and the semantic-ID codebook.

This is what a checkpoint holds and what every Triton model loads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from backend_src.config import RANKER_MICROBATCH, DecodeOptions, ModelConfig
from backend_src.decoding.beam_search import BeamResult, generate
from backend_src.model.covisitation import CoVisitation
from backend_src.model.decoder import SemanticIdDecoder
from backend_src.model.hstu import HistoryCache, HSTUEncoder
from backend_src.model.ranker import MFalconRanker
from backend_src.model.semantic_ids import SemanticIdCodebook
from genrec_contract.protocol import preview

CHECKPOINT_FORMAT = 1
# What each served stage runs; its artifact (save_stage) holds these parts only. "vocabulary" is
# the raw item ids (the encoder reads them in, the ranker writes them out); every stage holds it and
# the codebook, with which it places the catalog's added items as the others do (model/catalog.py).
MODEL_PARTS = ("backbone", "decoder", "ranker", "covisitation", "codebook", "vocabulary")
STAGE_PARTS = {
    "encoder": ("backbone", "codebook", "vocabulary"),
    "decoder": ("decoder", "codebook", "vocabulary"),
    "ranker": ("backbone", "ranker", "covisitation", "codebook", "vocabulary"),
    "catalog": ("codebook", "vocabulary"),  # the catalog's management model: places and checks items
}


def fuse(rank_scores: torch.Tensor, log_probs: torch.Tensor, weight, dense_log_probs: torch.Tensor | None = None,
         dense_weight=0.0, covisit_scores: torch.Tensor | None = None, covisit_weight=0.0,
         content_scores: torch.Tensor | None = None, content_weight=0.0) -> torch.Tensor:
    """The fused order's score, retrieval log-probability + weight * M-FALCON logit + dense_weight
    * the dense head's log-softmax + covisit_weight * the co-visitation score + content_weight * the
    content score of items added to the catalog (a product of the experts); each weight is a number
    or broadcasts against the scores (e.g. [B, 1], one per request). A candidate the ranker scores
    -inf (an empty slot) stays -inf (also where a zero weight made 0 * -inf a NaN)."""
    scores = log_probs + weight * rank_scores
    if dense_log_probs is not None:
        scores = scores + dense_weight * dense_log_probs
    if covisit_scores is not None:
        scores = scores + covisit_weight * covisit_scores
    if content_scores is not None:
        scores = scores + content_weight * content_scores
    return scores.masked_fill(rank_scores == float("-inf"), float("-inf"))


CONTENT_PROFILE_EVENTS = 3  # a user's last events whose content the catalog's added items are compared with


def append_candidates(items, log_probs, codes, extra, extra_codes):
    """The beam's candidates items/log_probs [B, W] and codes [B, W, C] followed by `extra` [B, X]
    (0 = none; one already among the beam's is dropped), codes extra_codes [B, X, C]: the extra
    candidates take each row's lowest finite beam log-probability (a candidate the beam did not
    generate is at most as likely as its last)."""
    extra = extra.masked_fill((extra[:, :, None] == items[:, None, :]).any(-1), 0)
    lowest = log_probs.masked_fill(~torch.isfinite(log_probs), float("inf")).min(1, keepdim=True).values
    lowest = lowest.masked_fill(~torch.isfinite(lowest), float("-inf"))
    extra_lp = lowest.expand(-1, extra.shape[1]).masked_fill(extra == 0, float("-inf"))
    return (torch.cat([items, extra], 1), torch.cat([log_probs, extra_lp.to(log_probs.dtype)], 1),
            torch.cat([codes, extra_codes.masked_fill((extra == 0)[:, :, None], -1).to(codes.dtype)], 1))


def log_softmax_at(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """scores [B, I+1] of every item -> [B, W] their log-softmax at candidates [B, W] item indices."""
    return torch.log_softmax(scores.float(), -1).gather(1, candidates.clamp_min(0))


def seen_in_history(candidates: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """candidates [B, W], history [B, N] item indices -> [B, W] bool: the candidate is one of its
    row's history items (a history padded with 0 matches only the empty candidate 0)."""
    return (candidates[:, :, None] == history[:, None, :]).any(-1)


RANK_ORDERS = ("fused", "ranker")


def served_order(
    rank_scores: torch.Tensor,  # [B, W] ranker logits (-inf for empty candidates)
    log_probs: torch.Tensor,  # [B, W] retrieval log-probabilities of the candidates
    candidates: torch.Tensor,  # [B, W] item indices, 0 = empty beam
    history_items: torch.Tensor | None = None,  # [B, N] item indices (0 = padding); needed to exclude seen
    *,
    fusion_weight=1.0,  # a number, or [B, 1]: one per row
    dense_log_probs: torch.Tensor | None = None,  # [B, W] the dense head's log-softmax at the candidates
    dense_weight=0.0,  # a number, or [B, 1]
    covisit_scores: torch.Tensor | None = None,  # [B, W] the co-visitation score of the candidates
    covisit_weight=0.0,  # a number, or [B, 1]
    content_scores: torch.Tensor | None = None,  # [B, W] content cosine of catalog-added candidates (0 for others)
    content_weight=0.0,
    rank_by: str = "fused",
    exclude_seen=False,  # a bool, or [B] bool: one per row
    top_k: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The served order, the one definition the model, the server and the evaluation share.

    score = log_prob + fusion_weight * rank_score [+ dense_weight * dense_log_prob] [+ covisit_weight *
    covisit_score] ("fused", `fuse`)
    or rank_score ("ranker"). A candidate is dropped (score -inf) when it is empty (item 0), has no
    finite score, or, with exclude_seen, is in its row's history. The min(top_k, W) best come
    first; ties keep the candidates' order (the beam order). A dropped or missing candidate leaves an empty slot: item 0, score and
    log-probability -inf, after every real one.

    Returns [B, min(top_k, W)] each: (items, scores, log_probs, positions), positions being the
    columns of `candidates` the slots came from (to gather e.g. semantic IDs; mask empty slots
    with items == 0)."""
    if rank_by == "fused":
        scores = fuse(rank_scores, log_probs, fusion_weight, dense_log_probs, dense_weight, covisit_scores, covisit_weight,
                      content_scores, content_weight)
    elif rank_by == "ranker":
        scores = rank_scores
    else:
        raise ValueError(f"rank_by must be one of {RANK_ORDERS}, got {rank_by!r}")
    drop = (candidates == 0) | ~torch.isfinite(scores)
    exclude = torch.as_tensor(exclude_seen, device=candidates.device).reshape(-1, 1)  # [1, 1] or [B, 1]
    if bool(exclude.any()):
        if history_items is None:
            raise ValueError("exclude_seen needs history_items")
        drop |= seen_in_history(candidates, history_items) & exclude
    scores = scores.masked_fill(drop, float("-inf"))
    # a stable sort, not topk: equal scores keep the beam order on every runtime and batch shape
    positions = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :top_k]
    top = torch.gather(scores, 1, positions)
    empty = top == float("-inf")
    items = torch.gather(candidates, 1, positions).masked_fill(empty, 0)
    top_log_probs = torch.gather(log_probs, 1, positions).masked_fill(empty, float("-inf"))
    return items, top, top_log_probs, positions


@dataclass
class Recommendations:
    items: torch.Tensor  # [B, K] item index (0 = empty slot)
    rank_scores: torch.Tensor  # [B, K] the served order's score: fused, or the ranker logit (-inf for empty slots)
    log_probs: torch.Tensor  # [B, K] retrieval log-probability of the item's semantic ID (-inf for empty slots)
    codes: torch.Tensor  # [B, K, 4] semantic IDs (-1 for empty slots)


def content_vectors(num_items: int, dim: int = 8) -> torch.Tensor:
    """[num_items, dim] unit vectors, the same for every call: the content an untrained model's
    semantic IDs are quantized from (item i's is row i - 1)."""
    return F.normalize(torch.randn(num_items, dim, generator=torch.Generator().manual_seed(0)), dim=-1)


class GenerativeRecommender(nn.Module):
    def __init__(self, cfg: ModelConfig, codebook: SemanticIdCodebook, item_ids: Sequence, parts: Sequence = MODEL_PARTS):
        """`parts`: the subset of MODEL_PARTS to build (a served stage's); the others are None
        (the vocabulary: only the padding index)."""
        super().__init__()
        unknown = set(parts) - set(MODEL_PARTS)
        if unknown or ("ranker" in parts and "backbone" not in parts):
            raise ValueError(f"parts must be a subset of {MODEL_PARTS} (the ranker needs the backbone), got {tuple(parts)}")
        self.cfg = cfg
        self.parts = tuple(p for p in MODEL_PARTS if p in parts)
        self.backbone = HSTUEncoder(cfg) if "backbone" in parts else None
        if self.backbone is not None and self.backbone.code_embedding is not None and len(codebook.codes):
            self.backbone.set_item_codes(codebook.codes)
        self.decoder = SemanticIdDecoder(cfg) if "decoder" in parts else None
        self.ranker = MFalconRanker(self.backbone, cfg) if "ranker" in parts else None
        # the table is filled from the training events (training.build_model) or a checkpoint
        self.covisitation = (CoVisitation(cfg.num_items, cfg.covisit_window)
                             if "covisitation" in parts and cfg.covisit_window else None)
        self.codebook = codebook if "codebook" in parts else None
        if "vocabulary" not in parts:
            item_ids = [None]
        self.item_ids = np.asarray(item_ids, dtype=object)  # raw id of each item index; [0] = None
        self._index = {str(raw): i for i, raw in enumerate(self.item_ids) if i > 0}
        self._row_ids = None  # row_ids(), built on first use
        # the rows of the item table that are items: not the padding row, not the unknown item's
        live = torch.zeros(cfg.num_items + 2, dtype=torch.bool)
        live[1 : cfg.num_items + 1] = True
        self.register_buffer("item_live", live, persistent=False)
        self.rows_in_use = cfg.num_items + 2  # rows past these hold nothing yet (an ItemCatalog's reserve)

    # ---------------------------------------------------------------- persistence
    def save(self, path, metadata: dict | None = None, fold_codes: bool = True) -> None:
        """The whole model; code embeddings folded into the item table unless not fold_codes
        (a training state, to resume)."""
        if self.parts != MODEL_PARTS:
            raise ValueError(f"a checkpoint needs the whole model; this one has {self.parts} (save_stage?)")
        state, cfg = self.state_dict(), self.cfg
        if fold_codes and self.backbone.code_embedding is not None:
            folded = {"backbone.item_embedding.weight": self.backbone.item_table().detach().clone(),
                      # kept: the catalog builds an added item's vector from its codes' embeddings
                      "backbone.catalog_code_embedding": self.backbone.code_embedding.weight.detach().clone()}
            state = {k: next((t for name, t in folded.items() if k.endswith(name)), v) for k, v in state.items()
                     if not k.endswith(("backbone.item_code_rows", "backbone.code_embedding.weight"))}
            cfg = dataclasses.replace(cfg, code_embedding_levels=0, catalog_code_levels=cfg.code_embedding_levels)
        self._write(path, state, metadata or {}, cfg=cfg)

    def save_stage(self, path, stage: str, metadata: dict | None = None) -> None:
        """What the served stage `stage` (a key of STAGE_PARTS) loads: the checkpoint's format
        with that stage's parts only; `load` reads it back as a model of those parts."""
        if self.backbone is not None and self.backbone.code_embedding is not None:
            raise ValueError("a stage is written from a checkpoint (code embeddings folded), not from a training model")
        parts = STAGE_PARTS[stage]
        modules = tuple(f"{p}." for p in parts if p != "vocabulary")
        state = {k: v for k, v in self.state_dict().items() if k.startswith(modules)}
        if metadata is None:  # the checkpoint's, less what only resuming training reads (optimizer, RNG)
            metadata = {k: v for k, v in getattr(self, "metadata", {}).items() if k != "train_state"}
        self._write(path, state, metadata, stage=stage)

    def _write(self, path, state_dict: dict, metadata: dict, stage: str | None = None, cfg=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        blob = {
            "format": CHECKPOINT_FORMAT,
            "config": (cfg or self.cfg).to_dict(),
            "state_dict": state_dict,
            "item_ids": [None if x is None else str(x) for x in self.item_ids],
            "metadata": metadata,
        }
        if stage is not None:
            blob["stage"] = stage
            if "vocabulary" not in STAGE_PARTS[stage]:
                blob["item_ids"] = [None]
        torch.save(blob, tmp)
        tmp.replace(path)  # atomic: a reader never sees half a checkpoint

    @classmethod
    def load(cls, path, map_location="cpu") -> "GenerativeRecommender":
        """A checkpoint (the whole model) or a stage's artifact (save_stage: that stage's parts)."""
        blob = torch.load(path, map_location=map_location, weights_only=False)
        if blob.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: unsupported checkpoint format {blob.get('format')!r}")
        cfg = ModelConfig.from_dict(blob["config"])
        stage = blob.get("stage")
        parts = STAGE_PARTS[stage] if stage else MODEL_PARTS
        # tables take the stored shapes
        model = cls(cfg, SemanticIdCodebook(num_levels=cfg.num_codes), blob["item_ids"], parts=parts)
        model.load_state_dict(blob["state_dict"])
        model.metadata = blob.get("metadata", {})
        model.stage = stage
        return model.eval()

    @classmethod
    def untrained(cls, item_ids: Sequence, max_history: int, seed: int, d_model: int = 16, num_layers: int = 2,
                  num_heads: int = 2, levels: int = 3, codes_per_level: int = 4) -> "GenerativeRecommender":
        """Random weights, and semantic IDs quantized (residual k-means) from random content vectors
        (`content_vectors`: the catalog takes an added item's content in this space) over `item_ids`
        (index 0 = None): for tests and benchmarks of the serving path, which check plumbing and
        speed, not quality."""
        from backend_src.model.semantic_ids import assign_collision_codes, residual_kmeans

        content = content_vectors(len(item_ids) - 1)
        codes, centers = residual_kmeans(content, (codes_per_level,) * levels, iters=10, return_centers=True)
        codebook = SemanticIdCodebook(assign_collision_codes(codes), centers=centers, content=content)
        cfg = ModelConfig(
            num_items=len(item_ids) - 1, d_model=d_model, num_layers=num_layers, num_heads=num_heads,
            max_seq_len=max_history, codebook_sizes=tuple(int(s) for s in codebook.codebook_sizes),
            decoder_heads=num_heads, dropout=0.0, semantic_id_source="random-vectors",
        )
        torch.manual_seed(seed)
        return cls(cfg, codebook, list(item_ids)).eval()

    # ---------------------------------------------------------------- vocabulary
    @property
    def unknown_index(self) -> int:
        """The item index of an item the model does not know (its learned unknown-item vector)."""
        return self.cfg.num_items + 1

    def item_indices(self, raw_ids: Sequence, strict: bool = True) -> np.ndarray:
        """Raw ids -> item indices. Unknown ids raise KeyError naming them, or map to
        `unknown_index` when not `strict` (events are never refused for their item)."""
        get = self._index.get  # indices start at 1: 0 marks an id not found yet
        out = np.fromiter(map(get, raw_ids, repeat(0)), dtype=np.int64, count=len(raw_ids))  # ids as str: one pass of C
        for j in np.flatnonzero(out == 0):  # bytes or ints name the item their str form names
            raw = raw_ids[j]
            out[j] = get(raw.decode() if isinstance(raw, bytes) else str(raw), 0)
        missing = np.flatnonzero(out == 0)
        if len(missing) and strict:
            shown = ", ".join(preview(raw_ids[j]) for j in missing[:5])  # an id may be as long as a request allows
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise KeyError(f"unknown item ids: {shown}{more}")
        out[missing] = self.unknown_index
        return out

    @property
    def item_rows(self) -> int:
        """Rows of the item table: padding, the items, the unknown item (and an ItemCatalog's reserve)."""
        return int(self.item_live.shape[0])

    @property
    def vocabulary_size(self) -> int:
        """Raw ids this model maps (0 for a stage without the vocabulary)."""
        return len(self._index)

    def add_vocabulary(self, raw_ids: Sequence, first_row: int) -> None:
        """Items added to the catalog: raw_ids[j] is row first_row + j."""
        self._index.update((str(raw), first_row + j) for j, raw in enumerate(raw_ids))
        self._row_ids = None

    def row_ids(self) -> np.ndarray:
        """The raw id of every row of the item table (None where a row is no item)."""
        if self._row_ids is None or len(self._row_ids) != self.item_rows:
            out = np.full(self.item_rows, None, dtype=object)
            for raw, row in self._index.items():
                out[row] = raw
            self._row_ids = out
        return self._row_ids

    # ---------------------------------------------------------------- inference
    def encode(self, items, actions, timestamps, lengths) -> HistoryCache:
        return self.backbone(items, actions, timestamps, lengths)

    def append(self, cache: HistoryCache, items, actions, timestamps, new_lengths, in_place: bool = False) -> HistoryCache:
        return self.backbone.append(cache, items, actions, timestamps, new_lengths, in_place=in_place)

    def retrieve(self, cache: HistoryCache, options: DecodeOptions) -> BeamResult:
        return self.retrieve_states(cache.states, cache.lengths, options)

    def retrieve_states(self, states: torch.Tensor, lengths: torch.Tensor, options: DecodeOptions) -> BeamResult:
        """Beam search over the final states [B, n, D] of histories of `lengths` [B] (all that
        retrieval reads of a history)."""
        return generate(self.decoder, self.codebook, states, lengths, options)

    def dense_operands(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(query [..., D], item table [I+1, D]) whose products are the dense head's scores:
        state . E_item, or cos(state, E_item) / cfg.dense_temperature when that is > 0."""
        emb = self.backbone.item_table()[: self.rows_in_use]
        t = self.cfg.dense_temperature
        if t > 0:
            return F.normalize(states, dim=-1) / t, F.normalize(emb, dim=-1)
        return states, emb

    def dense_scores(self, states: torch.Tensor) -> torch.Tensor:
        """states [..., D] -> [..., rows] scores of every row of the item table by the dense
        auxiliary head; the rows that are no item (0, the padding row, and the unknown item's)
        score -inf."""
        query, emb = self.dense_operands(states)
        return (query @ emb.T).masked_fill_(~self.item_live[: self.rows_in_use], float("-inf"))

    def dense_log_probs(self, user_states: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """user_states [B, D] (each history's last state), candidates [B, W] item indices -> [B, W]
        the dense head's log-softmax over all items at the candidates (-inf at item 0)."""
        return log_softmax_at(self.dense_scores(user_states), candidates)

    def covisit_scores(self, history_items: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor | None:
        """history_items [B, N] (0 after each row's events), candidates [B, W] -> [B, W] the
        co-visitation expert's scores, or None where the model has none."""
        return None if self.covisitation is None else self.covisitation.scores(history_items, candidates)

    # ---- the catalog's added items: content ----------------------------------------------------
    @property
    def has_added_items(self) -> bool:
        return self.rows_in_use > self.cfg.num_items + 2

    def content_profile(self, history_items: torch.Tensor) -> torch.Tensor | None:
        """history_items [B, N] (0 after each row's events) -> [B, E] the unit mean content embedding
        of each user's last CONTENT_PROFILE_EVENTS items; None where the model kept no content."""
        content = self.codebook.content if self.codebook is not None else None
        if content is None or not content.numel():
            return None
        gaps = torch.arange(1, CONTENT_PROFILE_EVENTS + 1, device=history_items.device)
        at = (history_items > 0).sum(1, keepdim=True) - gaps
        last = history_items.gather(1, at.clamp_min(0)).masked_fill(at < 0, 0).to(content.device)
        last = last.masked_fill(last >= content.shape[0], 0)  # a row with no content yet (the unknown item's): none
        return F.normalize(content[last].sum(1), dim=-1)

    def added_candidates(self, profile: torch.Tensor, history_items: torch.Tensor, count: int) -> torch.Tensor:
        """[B, count] the live items added to the catalog nearest in content to `profile` and not in
        the history (0 where fewer)."""
        first, n = self.cfg.num_items + 2, self.rows_in_use
        scores = profile @ self.codebook.content[first:n].T  # [B, A]
        scores = scores.masked_fill(~self.item_live[first:n], float("-inf"))
        A = n - first
        cols = (history_items - first).to(scores.device)  # an added item of the history -> its column
        cols = cols.masked_fill((cols < 0) | (cols >= A), A)  # any other row -> a spare column, then dropped
        scores = F.pad(scores, (0, 1)).scatter(1, cols, float("-inf"))[:, :A]
        top = scores.topk(min(count, A), dim=1)
        return (top.indices + first).masked_fill(top.values == float("-inf"), 0)

    def catalog_content_scores(self, profile: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[B, W] the content cosine of each candidate added to the catalog with `profile`, 0 for the others."""
        content = self.codebook.content
        added = (candidates >= self.cfg.num_items + 2) & (candidates < content.shape[0])
        return ((content[candidates.masked_fill(~added, 0)] * profile[:, None, :]).sum(-1) * added).float()

    def with_added_candidates(self, history_items, items, log_probs, codes) -> tuple:
        """The fused order's candidates items/log_probs [B, W] and codes [B, W, C] with the catalog's
        `cfg.catalog_candidates` added items nearest in content appended (append_candidates), and
        the candidates' content scores [B, W'] (None where nothing was added or no content was kept)."""
        if not self.has_added_items:
            return items, log_probs, codes, None
        if history_items is None:
            raise ValueError("the catalog's added items need history_items")
        profile = self.content_profile(history_items)
        if profile is None:
            return items, log_probs, codes, None
        if self.cfg.catalog_candidates:
            extra = self.added_candidates(profile, history_items, self.cfg.catalog_candidates)
            items, log_probs, codes = append_candidates(items, log_probs, codes, extra, self.codebook.codes[extra].to(codes.dtype))
        return items, log_probs, codes, self.catalog_content_scores(profile, items)

    def rank(self, cache: HistoryCache, candidates: torch.Tensor, microbatch_size: int = RANKER_MICROBATCH) -> torch.Tensor:
        return self.ranker.score(cache, candidates, microbatch_size)

    @torch.no_grad()
    def recommend(
        self,
        cache: HistoryCache,
        options: DecodeOptions,
        top_k: int = 10,
        microbatch_size: int = RANKER_MICROBATCH,
        exclude_seen: bool = False,
        history_items: torch.Tensor | None = None,  # [B, N] needed when exclude_seen or u != 0
        rank_by: str = "fused",
    ) -> Recommendations:
        """Retrieve beam_width candidates by semantic-ID beam search, rank them with M-FALCON
        against the same cached history, return the top_k in the served order (`served_order`:
        "ranker": the M-FALCON logit; "fused": retrieval log-probability + w * logit + v * dense
        log-softmax + u * co-visitation score, (w, v, u) = cfg.fusion_weights(exclude_seen))."""
        beams = self.retrieve(cache, options)
        cands, cand_lp, cand_codes, content = beams.item_ids, beams.log_probs, beams.codes, None
        fused = rank_by == "fused"
        if fused:  # the catalog's added items nearest in content join the candidates
            cands, cand_lp, cand_codes, content = self.with_added_candidates(history_items, cands, cand_lp, cand_codes)
        rank_scores = self.rank(cache, cands, microbatch_size)  # [B, W]; -inf for empty beams
        w, v, u = self.cfg.fusion_weights(exclude_seen)
        dense = self.dense_log_probs(cache.last_states(), cands) if v else None
        covisit = None
        if u and fused:
            if history_items is None:
                raise ValueError("the co-visitation expert needs history_items")
            covisit = self.covisit_scores(history_items, cands)
        items, scores, log_probs, top = served_order(
            rank_scores, cand_lp, cands, history_items, fusion_weight=w, dense_log_probs=dense,
            dense_weight=v, covisit_scores=covisit, covisit_weight=u, content_scores=content,
            content_weight=self.cfg.catalog_content_weight, rank_by=rank_by, exclude_seen=exclude_seen, top_k=top_k,
        )
        codes = torch.gather(cand_codes, 1, top[:, :, None].expand(-1, -1, cand_codes.shape[-1]))
        return Recommendations(
            items=items,
            rank_scores=scores,
            log_probs=log_probs,
            codes=codes.masked_fill((items == 0)[:, :, None], -1),  # an empty slot names no item
        )
