"""What the beams attend over at each decoding step: one small policy object per attention mode.

`generate` (beam_search.py) runs one loop over the decoding steps and asks its policy, at every
step t, for the beams' attention output over the user's history:

    policy = attention_policy(decoder, states, lengths, options).prepare()
    for t in range(T):
        attn = policy.attend(t, q, beam_lp)      # [B, W_t, H, dh]
        ... expand, keep the best W beams, parent [B, W] ...
        policy.reorder(parent)                   # per-beam state follows its parent beam

Policies, s = options.selection_step, k_t = options.budget(t) = max(1, ceil(k r^(t-s))):
  FullAttention            every step over the whole history (optionally recording the weights)
  ProgressiveFocus         PFA: steps < s full; at s ONE ranking of the rows shared by all beams;
                           the kept rows gathered once; step t >= s reads the first k_t of them
  ProgressiveFocusPerBeam  as PFA, but every beam ranks the rows itself (reordered with its parent)
  DynamicTopK              steps < s full; from s on every beam picks its own top k_t rows, every step
Users and beams are tensor dimensions throughout; every op goes through the `backend_src.ops`
dispatcher (looked up at call time), so CUDA tensors take the Triton kernels.
"""
from __future__ import annotations

import torch

from backend_src import ops
from backend_src.config import DecodeOptions


def beam_weights(log_probs: torch.Tensor) -> torch.Tensor:
    """w_b = p_b / sum_j p_j over a user's beams (dead beams get 0)."""
    w = torch.softmax(log_probs, dim=1)
    return torch.nan_to_num(w, nan=0.0)


class AttentionPolicy:
    """Base: full attention over the whole history before the selection step.

    states [B, N, D] (left-aligned), lengths [B] long; `kv(t)` is step t's projected K/V of all
    N rows, [B, N, H, dh] each (a shared-projection decoder has one pair, projected once)."""

    def __init__(self, decoder, states: torch.Tensor, lengths: torch.Tensor, options: DecodeOptions):
        self.decoder, self.states, self.lengths, self.options = decoder, states, lengths, options
        self.s = options.selection_step
        self.records = []  # per-step attention statistics (FullAttention with collect_attention)
        self._shared_kv = None

    def prepare(self) -> "AttentionPolicy":
        """Once per decode, before the first step. Projections are per step and lazy (step 0's
        single beam attends in state space and projects no row)."""
        return self

    def kv(self, t: int):
        if self.decoder.shared_kv_projection:
            self._shared_kv = self._shared_kv or self.decoder.project_step(self.states, t)
            return self._shared_kv
        return self.decoder.project_step(self.states, t)

    def attend(self, t: int, q: torch.Tensor, beam_lp: torch.Tensor) -> torch.Tensor:
        """q [B, W_t, H, dh] beam queries, beam_lp [B, W_t] -> attention output [B, W_t, H, dh]."""
        if t < self.s:
            return self.attend_full(t, q, beam_lp)
        return self.attend_focused(t, q, beam_lp)

    def attend_full(self, t: int, q: torch.Tensor, beam_lp: torch.Tensor) -> torch.Tensor:
        if q.shape[1] == 1:  # one beam a user (step 0): attend in state space, no projection of the N rows
            return self.decoder.attend_states(q, self.states, self.lengths, t)
        K, V = self.kv(t)
        return ops.decode_attention(q, K, V, self.lengths)

    def attend_focused(self, t: int, q: torch.Tensor, beam_lp: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reorder(self, parent: torch.Tensor) -> None:
        """parent [B, W] (the surviving beams' parents): per-beam state follows its parent."""


class FullAttention(AttentionPolicy):
    """Every beam attends over the whole history at every step."""

    def attend(self, t, q, beam_lp):
        if not self.options.collect_attention:
            return self.attend_full(t, q, beam_lp)
        K, V = self.kv(t)
        probs = ops.attention_probs(q, K, self.lengths)  # [B, W_t, H, N]
        w = beam_weights(beam_lp)
        per_beam = probs.mean(2)  # head-averaged
        self.records.append(
            dict(step=t, weights=torch.einsum("bw,bwn->bn", w, per_beam), beam_weights=w, per_beam=per_beam)
        )
        return torch.einsum("bwhn,bnhd->bwhd", probs, V)


class ProgressiveFocus(AttentionPolicy):
    """PFA. At the selection step s every beam's head-averaged softmax weights over the rows,
    weighted by its normalized generation probability w_b = p_b / sum_j p_j, are pooled into one
    score per row, a_n = sum_b w_b mean_h softmax_n(q_bh . K_nh / sqrt(dh)) over the keys of
    every row; the top k rows (importance-sorted) are gathered ONCE into contiguous memory, in the
    same call (`ops.pfa_select_rows`), and projected for step s and every later step u, only the
    first k_u of them (values are never projected for a dropped row). Step t >= s attends over the
    prefix of k_t = max(1, ceil(k r^(t-s))) kept rows (k_s = k): no index gathers after selection.
    The selection step's own weights over its kept rows, renormalized, are the softmax over those
    rows, so step s attends over the kept block as the later steps do."""

    kept: dict  # step u -> (K, V) of the kept rows, [B, k_u, H, dh] each
    kept_len: torch.Tensor  # [B] rows kept per user (min(k, length))

    def select(self, t: int, q: torch.Tensor, beam_lp: torch.Tensor) -> None:
        dec, opts, T = self.decoder, self.options, self.decoder.num_steps
        if min(opts.budget(u) for u in range(t, T)) >= self.states.shape[1]:
            # every step keeps every row (a history no longer than the smallest k_t): the ranking
            # would only reorder them, which attention does not see
            self.kept_len = self.lengths
            self.kept = {u: self.kv(u) for u in range(t, T)}
            return
        # one shared ranking from the beams' pooled weights over every row's key
        K = self.kv(t)[0] if dec.shared_kv_projection else dec.project_step(self.states, t, "k")
        # the kept rows of this and every later step, gathered once into contiguous memory by the
        # selecting call itself (one launch on a GPU): K and V, or the states
        rows = tuple(self.kv(t)) if dec.shared_kv_projection else (self.states,)
        kept, self.kept_len = ops.pfa_select_rows(q, K, self.lengths, beam_weights(beam_lp), opts.k, rows)
        if dec.shared_kv_projection:
            self.kept = dict.fromkeys(range(t, T), kept)  # (K, V) [B, k, H, dh] each
        else:
            kept_states = kept[0]  # [B, k, D]
            # (step u reads only its first k_u rows: project just those; k_s = k)
            self.kept = {u: dec.project_step(kept_states[:, : opts.budget(u)], u) for u in range(t, T)}

    def attend_focused(self, t, q, beam_lp):
        if t == self.s:
            self.select(t, q, beam_lp)
        kt = self.options.budget(t)
        K, V = self.kept[t]
        return ops.decode_attention(q, K[:, :kt], V[:, :kt], self.kept_len.clamp(max=kt))


class ProgressiveFocusPerBeam(AttentionPolicy):
    """PFA with a ranking per beam: at s every beam keeps its own top k rows by its own
    head-averaged weights (`ops.dynamic_topk_attention`, returning the order); step t > s attends
    over each beam's first k_t rows, gathered from that step's K/V. The orders follow their
    parents through `reorder`."""

    order = None  # [B, W, k] each beam's rows, importance-sorted
    kept_len = None  # [B, W]

    def attend_focused(self, t, q, beam_lp):
        K, V = self.kv(t)
        B, Wt, H, dh = q.shape
        if t == self.s:  # every beam ranks the rows by its own weights
            attn, self.order = ops.dynamic_topk_attention(q, K, V, self.lengths, self.options.k, return_indices=True)
            self.kept_len = self.lengths.clamp(max=self.order.shape[2])[:, None].expand(B, Wt)
            return attn
        kt = min(self.options.budget(t), self.order.shape[2])
        rows = self.order[:, :, :kt].reshape(B, Wt * kt)  # each beam's own prefix
        kb = ops.gather_rows(K, rows).view(B * Wt, kt, H, dh)
        vb = ops.gather_rows(V, rows).view(B * Wt, kt, H, dh)
        qb = q.reshape(B * Wt, 1, H, dh)  # every beam is its own "user"
        return ops.decode_attention(qb, kb, vb, self.kept_len.clamp(max=kt).reshape(-1)).view(B, Wt, H, dh)

    def reorder(self, parent):
        if self.order is not None:
            self.order = ops.gather_rows(self.order, parent)
            self.kept_len = torch.gather(self.kept_len, 1, parent)


class DynamicTopK(AttentionPolicy):
    """From step s on every beam attends over its own top k_t rows of that step, chosen anew each step."""

    def attend_focused(self, t, q, beam_lp):
        K, V = self.kv(t)
        return ops.dynamic_topk_attention(q, K, V, self.lengths, self.options.budget(t))


POLICIES = {
    "full": FullAttention,
    "pfa": ProgressiveFocus,
    "pfa_per_beam": ProgressiveFocusPerBeam,
    "dynamic_topk": DynamicTopK,
}


def attention_policy(decoder, states, lengths, options: DecodeOptions) -> AttentionPolicy:
    """The policy of options.mode over this batch's history (states [B, N, D], lengths [B])."""
    if options.mode not in POLICIES:
        raise ValueError(f"unknown mode {options.mode!r}")
    if options.collect_attention and options.mode != "full":
        raise ValueError("collect_attention needs mode='full' (the statistics are over full attention)")
    return POLICIES[options.mode](decoder, states, lengths, options)
