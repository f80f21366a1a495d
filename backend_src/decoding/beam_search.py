"""Batched constrained beam search over semantic IDs with switchable history attention.

Modes (DecodeOptions.mode), s = selection step:
  full          every beam attends over the whole history at every step
  pfa           seed 000: steps < s full; at step s the beams' head-averaged weights, each beam
                weighted by its normalized generation probability, rank the history once for all
                beams; the top k rows are gathered once into contiguous memory (their K/V projected
                for step s and every later step), and step t >= s attends over only the first
                k_t = max(1, ceil(k r^(t-s))) of them (k_s = k)
  pfa_per_beam  the same, but every beam keeps its own ranking (reordered with its parent)
  dynamic_topk  steps < s full; from step s on every beam picks its own top k_t rows every step
Only codes that continue an existing item are ever expanded, so every result is a real item.
Loops run over the 4 decoding steps only; users and beams are tensor dimensions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend_src import ops
from backend_src.config import DecodeOptions

NEG_INF = float("-inf")


@dataclass
class BeamResult:
    item_ids: torch.Tensor  # [B, W] item indices, best first; 0 where fewer than W items exist
    codes: torch.Tensor  # [B, W, 4] semantic IDs (-1 for empty slots)
    log_probs: torch.Tensor  # [B, W] sequence log-probabilities (-inf for empty slots)
    # per-step attention records (collect_attention): dicts with
    #   step, weights [B, N] (beam-probability-weighted, head-averaged), beam_weights [B, W_t],
    #   per_beam [B, W_t, N] (head-averaged)
    attention: list = field(default_factory=list)


def _beam_weights(log_probs: torch.Tensor) -> torch.Tensor:
    """w_b = p_b / sum_j p_j over a user's beams (dead beams get 0)."""
    w = torch.softmax(log_probs, dim=1)
    return torch.nan_to_num(w, nan=0.0)


@torch.no_grad()
def generate(decoder, codebook, states: torch.Tensor, lengths: torch.Tensor, options: DecodeOptions) -> BeamResult:
    """states [B, N, D] history states (left-aligned), lengths [B] (>= 1) -> top-W items per user."""
    if tuple(decoder.sizes) != codebook.codebook_sizes:
        raise ValueError(f"decoder code sizes {decoder.sizes} != codebook sizes {codebook.codebook_sizes}")
    mode, s, W = options.mode, options.selection_step, options.beam_width
    if options.collect_attention and mode != "full":
        raise ValueError("collect_attention needs mode='full' (the statistics are over full attention)")
    B = states.shape[0]
    T = decoder.num_steps
    dev = states.device
    lengths = lengths.to(dev).long()
    user_state = states[torch.arange(B, device=dev), (lengths - 1).clamp_min(0)]  # [B, D] last state

    # one start beam per user
    prefix = torch.zeros(B, 1, dtype=torch.long, device=dev)  # level-t prefix ids (-1 = dead)
    beam_lp = torch.zeros(B, 1, device=dev)
    prefix_emb = torch.zeros(B, 1, decoder.d_model, device=dev, dtype=states.dtype)
    codes = torch.zeros(B, 1, 0, dtype=torch.long, device=dev)
    records = []
    kept = {}  # PFA: step -> K/V of the kept rows, [B, k, H, dh] each, importance-sorted
    kept_len = None  # [B]
    beam_order = beam_kept_len = None  # pfa_per_beam: [B, W, k], [B, W]
    shared_kv = None  # the single K/V pair of a shared-projection decoder

    def kv(t):  # the full-history K/V of step t (computed once; shared decoders have one pair)
        nonlocal shared_kv
        if decoder.shared_kv_projection:
            shared_kv = shared_kv or decoder.project_step(states, t)
            return shared_kv
        return decoder.project_step(states, t)

    for t in range(T):
        x, q = decoder.query(user_state, prefix_emb, t)  # [B, Wt, D], [B, Wt, H, dh]
        Wt = q.shape[1]
        if (mode == "full" or t < s) and Wt == 1 and not options.collect_attention:
            # one beam a user (step 0): attend in state space, no projection of the N rows
            attn = decoder.attend_states(q, states, lengths, t)
        elif mode == "full" or t < s:
            K, V = kv(t)
            if options.collect_attention:
                probs = ops.attention_probs(q, K, lengths)  # [B, Wt, H, N]
                attn = torch.einsum("bwhn,bnhd->bwhd", probs, V)
                w = _beam_weights(beam_lp)
                per_beam = probs.mean(2)
                records.append(
                    dict(step=t, weights=torch.einsum("bw,bwn->bn", w, per_beam), beam_weights=w, per_beam=per_beam)
                )
            else:
                attn = ops.decode_attention(q, K, V, lengths)
        elif mode == "pfa":
            if t == s:
                # one shared ranking from the beams' pooled weights over every row's key
                K = kv(t)[0] if decoder.shared_kv_projection else decoder.project_step(states, t, "k")
                order, kept_len = ops.pfa_select(q, K, lengths, _beam_weights(beam_lp), options.k)
                # the kept rows of this and every later step, gathered once into contiguous memory
                if decoder.shared_kv_projection:
                    kept = dict.fromkeys(range(t, T), (ops.gather_rows(K, order), ops.gather_rows(kv(t)[1], order)))
                else:
                    kept_states = ops.gather_rows(states, order)  # [B, k, D]
                    # (step u reads only its first k_u rows: project just those; k_s = k)
                    kept = {u: decoder.project_step(kept_states[:, : options.budget(u)], u) for u in range(t, T)}
            # the selection step's own weights over its kept rows, renormalized, are the softmax
            # over those rows: every step from s on attends over a prefix of the kept block
            kt = options.budget(t)
            K, V = kept[t]
            attn = ops.decode_attention(q, K[:, :kt], V[:, :kt], kept_len.clamp(max=kt))
        elif mode == "pfa_per_beam":
            K, V = kv(t)
            if t == s:  # every beam ranks the rows by its own weights
                attn, beam_order = ops.dynamic_topk_attention(q, K, V, lengths, options.k, return_indices=True)
                beam_kept_len = lengths.clamp(max=beam_order.shape[2])[:, None].expand(B, Wt)
            else:
                H, dh = q.shape[2], q.shape[3]
                kt = min(options.budget(t), beam_order.shape[2])
                rows = beam_order[:, :, :kt].reshape(B, Wt * kt)  # each beam's own prefix
                kb = ops.gather_rows(K, rows).view(B * Wt, kt, H, dh)
                vb = ops.gather_rows(V, rows).view(B * Wt, kt, H, dh)
                qb = q.reshape(B * Wt, 1, H, dh)  # every beam is its own "user"
                attn = ops.decode_attention(qb, kb, vb, beam_kept_len.clamp(max=kt).reshape(-1)).view(B, Wt, H, dh)
        elif mode == "dynamic_topk":
            K, V = kv(t)
            attn = ops.dynamic_topk_attention(q, K, V, lengths, options.budget(t))
        else:
            raise ValueError(f"unknown mode {mode!r}")

        # the codes that continue an existing item (a live prefix always has one): [B, Wt, M]
        # lists where the level's lists are short, else all C_t codes with -inf on the others
        kids, bias = codebook.continuations(prefix, t)
        logits = decoder.head(x, attn, t, codes=kids)  # [B, Wt, M]
        M = logits.shape[-1]
        step_lp = torch.log_softmax(logits.float() + bias, dim=-1)
        scores = step_lp.add_(beam_lp[:, :, None]).reshape(B, Wt * M)  # + the beam's score
        beam_lp, idx = torch.topk(scores, min(W, Wt * M), dim=1)  # sorted, best first
        parent = idx // M
        code = idx % M if kids is None else torch.gather(kids.reshape(B, Wt * M), 1, idx)
        alive = beam_lp > NEG_INF
        prefix = codebook.advance(torch.gather(prefix, 1, parent), code, t)
        prefix = torch.where(alive, prefix, torch.full_like(prefix, -1))
        code = torch.where(alive, code, torch.full_like(code, -1))
        codes = torch.cat([ops.gather_rows(codes, parent), code[:, :, None]], dim=2)
        if t + 1 < T:  # reorder per-beam state by parent (ops.gather_rows: x [B, W_old, ...] -> [B, W_new, ...])
            prefix_emb = ops.gather_rows(prefix_emb, parent) + decoder.code_embedding(code, t)
            if beam_order is not None:
                beam_order = ops.gather_rows(beam_order, parent)
                beam_kept_len = torch.gather(beam_kept_len, 1, parent)

    items = codebook.items_of(prefix)
    codes = codes.masked_fill((beam_lp == NEG_INF)[:, :, None], -1)  # dead beams name no item
    if items.shape[1] < W:  # fewer candidates than beams (tiny codebooks)
        pad = W - items.shape[1]
        items = torch.cat([items, items.new_zeros(B, pad)], 1)
        codes = torch.cat([codes, codes.new_full((B, pad, T), -1)], 1)
        beam_lp = torch.cat([beam_lp, beam_lp.new_full((B, pad), NEG_INF)], 1)
    return BeamResult(item_ids=items, codes=codes, log_probs=beam_lp, attention=records)
