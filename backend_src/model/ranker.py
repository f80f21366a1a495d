"""M-FALCON target-aware ranking head (Actions Speak Louder than Words: Trillion-Parameter
Sequential Transducers for Generative Recommendations, section 5).

Each candidate c becomes one token x_c = E_item[c] + E_action[RANK_ACTION] placed right after
the user's history (position = history length, time = last history timestamp) and runs through
every backbone layer. At each layer the candidates of a microbatch attend to that layer's
cached history K/V and to their own key only (the M-FALCON mask), so
  * a candidate's state equals appending it alone to the history and encoding causally,
  * scores do not depend on the order of candidates or on the microbatch size,
  * the history is encoded once (the cache) and only read here: O(n^2 + m n), not O(m n^2).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from backend_src.config import RANKER_MICROBATCH, ModelConfig
from backend_src.model.hstu import HistoryCache, HSTUEncoder

RANK_ACTION = 7  # action id of a ranking-target token


class MFalconRanker(nn.Module):
    """Scores candidates with the backbone's layers over a ``HistoryCache``.

    The backbone is registered as a submodule (its parameters are shared, not copied), so the
    ranker can be trained and exported on its own.
    """

    def __init__(self, backbone: HSTUEncoder, cfg: ModelConfig):
        super().__init__()
        if cfg.num_actions <= RANK_ACTION:
            raise ValueError(f"num_actions must be > {RANK_ACTION} (the ranking-target action id)")
        self.backbone = backbone
        self.cfg = cfg
        D = cfg.d_model
        # score = MLP(h) + <h, e_c>: a learned head plus the candidate-item affinity
        self.head = nn.Sequential(nn.Linear(D, D), nn.SiLU(), nn.Linear(D, 1))

    # ---- candidate states ---------------------------------------------------------------
    def candidate_states(
        self,
        cache: HistoryCache,
        candidates: torch.Tensor | None,  # [B, M] long
        num_history: torch.Tensor,  # [B] long: history rows each user's candidates see
        cand_ts: torch.Tensor,  # [B] long: the candidates' timestamp
        microbatch_size: int | None = None,
        vectors: torch.Tensor | None = None,  # [B, M, D]: the candidates' item vectors instead of their ids
    ) -> torch.Tensor:
        """Final (normalized) states [B, M, D] of the candidate tokens at position num_history[b].

        Microbatches of b_m candidates: the keys of a microbatch are [history rows ; its own
        candidate rows], q_self points each candidate at its own key, so candidates never see
        each other and the history K/V is read from the cache, never recomputed.
        """
        B, M = (candidates if vectors is None else vectors).shape[:2]
        N = cache.num_rows
        bm = M if not microbatch_size else max(1, min(int(microbatch_size), M))
        dev = num_history.device
        hist_pos = torch.arange(N, device=dev).expand(B, N)
        layers = self.backbone.layers
        out = []
        for s in range(0, M, bm):  # microbatches; everything inside is batched over users
            part = candidates[:, s : s + bm] if vectors is None else vectors[:, s : s + bm]
            m = part.shape[1]
            action = torch.full_like(part if vectors is None else part[..., 0], RANK_ACTION, dtype=torch.long)
            embed = self.backbone.embed if vectors is None else self.backbone.embed_vectors
            x = embed(part, action)  # [B, m, D]
            q_pos = num_history[:, None].expand(B, m)
            q_ts = cand_ts[:, None].expand(B, m)
            k_pos = torch.cat([hist_pos, q_pos], dim=1)  # [B, N + m]
            k_ts = torch.cat([cache.timestamps, q_ts], dim=1)
            q_self = (N + torch.arange(m, device=dev)).expand(B, m)  # own key index
            shared = {"own_keys": m}  # the last m keys are the candidates' own: no [m, m] block
            for li, layer in enumerate(layers):
                u, q, k, v = layer.project(x)
                k_all = torch.cat([cache.keys[li], k], dim=1)  # [B, N + m, H, dqk]
                v_all = torch.cat([cache.values[li], v], dim=1)
                attn = layer.attend(q, k_all, v_all, q_pos, k_pos, q_ts, k_ts, num_history, q_self, shared)
                x = layer.output(x, attn, u)
            out.append(self.backbone.final_norm(x))
        if not out:
            return torch.zeros((B, 0, self.cfg.d_model), dtype=torch.float32, device=dev)
        return torch.cat(out, dim=1)

    def head_logits(self, states: torch.Tensor, candidates: torch.Tensor | None,
                    vectors: torch.Tensor | None = None) -> torch.Tensor:
        """[B, M, D] candidate states -> [B, M] logits; padding candidates (id 0) get -inf (given
        by their item vectors [B, M, D] instead of their ids: no candidate is padding)."""
        e = (self.backbone.item_vectors(candidates) if vectors is None else vectors) * self.backbone.embed_scale
        logits = self.head(states).squeeze(-1) + (states * e).sum(-1) / states.shape[-1] ** 0.5
        return logits if candidates is None else logits.masked_fill(candidates == 0, float("-inf"))

    # ---- serving ------------------------------------------------------------------------
    def score(self, cache: HistoryCache, candidates: torch.Tensor, microbatch_size: int = RANKER_MICROBATCH) -> torch.Tensor:
        """Logits [B, M] for candidates [B, M] after each user's whole cached history.

        Candidate position = cache.lengths (the next position), time = last history timestamp
        (0 for an empty history)."""
        last = (cache.lengths - 1).clamp(min=0)
        if cache.num_rows:
            ts = cache.timestamps.gather(1, last[:, None]).squeeze(1) * (cache.lengths > 0)
        else:
            ts = torch.zeros_like(cache.lengths)
        states = self.candidate_states(cache, candidates, cache.lengths, ts, microbatch_size)
        return self.head_logits(states, candidates)

    forward = score

    # ---- training -----------------------------------------------------------------------
    def training_loss(
        self,
        cache: HistoryCache,  # from backbone.forward on the training batch (with gradients)
        positions: torch.Tensor,  # [B] or [B, P] long: the last history row the candidates may see
        positives: torch.Tensor,  # [B] or [B, P] long: the true next item (0 = skip this one)
        negatives: torch.Tensor,  # [B, K] or [B, P, K] long: sampled negatives (0 = padding)
    ) -> torch.Tensor:
        """Sampled-softmax cross-entropy of the positive (index 0) against the negatives, with
        candidates placed right after history row positions[b] (they see rows <= positions[b]),
        the mean over every (user, position). Negatives equal to the positive are masked out."""
        if positions.dim() == 2:  # P positions per user: each user's rows once per position
            if positions.shape[1] > 1:
                cache = cache.select(torch.arange(cache.batch_size, device=cache.device).repeat_interleave(positions.shape[1]))
            positions, positives, negatives = positions.reshape(-1), positives.reshape(-1), negatives.flatten(0, 1)
        candidates = torch.cat([positives[:, None], negatives], dim=1)  # [B, 1 + K]
        ts = cache.timestamps.gather(1, positions[:, None]).squeeze(1)
        states = self.candidate_states(cache, candidates, positions + 1, ts, microbatch_size=None)
        dup = torch.cat([torch.zeros_like(positives[:, None], dtype=torch.bool), negatives == positives[:, None]], 1)
        logits = self.head_logits(states, candidates).masked_fill(dup, float("-inf"))
        ok = (positives > 0) & (positions < cache.lengths)
        if not bool(ok.any()):
            return logits.sum() * 0.0  # keeps the graph; nothing to learn from this batch
        target = torch.zeros(int(ok.sum()), dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits[ok], target)
