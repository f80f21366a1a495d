"""Batched constrained beam search over semantic IDs with switchable history attention.

Modes (DecodeOptions.mode), s = selection step, each an attention policy (attention_policies.py):
  full          FullAttention: every beam attends over the whole history at every step
  pfa           ProgressiveFocus (the PFA paper): steps < s full; at step s the beams' head-averaged
                weights, each beam weighted by its normalized generation probability, rank the
                history once for all beams; the top k rows are gathered once into contiguous memory
                (their K/V projected for step s and every later step), and step t >= s attends over
                only the first k_t = max(1, ceil(k r^(t-s))) of them (k_s = k)
  pfa_per_beam  ProgressiveFocusPerBeam: the same, but every beam keeps its own ranking (reordered
                with its parent)
  dynamic_topk  DynamicTopK: steps < s full; from step s on every beam picks its own top k_t rows
                every step
Only codes that continue an existing item are ever expanded, so every result is a real item.
One loop runs over the 4 decoding steps; users and beams are tensor dimensions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from backend_src import ops
from backend_src.config import DecodeOptions
from backend_src.decoding.attention_policies import attention_policy

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


def select_beams(logits, bias, beam_lp, kids, prefix, codebook, t: int, width: int) -> tuple:
    """One expansion: each beam's continuations [B, Wt, M] scored log_softmax(logits + bias) (bias
    0 / -inf) + the beam's score beam_lp [B, Wt]; the best min(width, Wt M) of a user's, best first
    -> (their scores, the beams they extend, their codes, their level-(t+1) prefix ids), [B, W]
    each; code and prefix -1 for a dead (-inf) beam. kids [B, Wt, M] the continuations' codes, or
    None where they are all C_t codes. One compiled call on the CPU (cpu_kernels.select_beams:
    ~20 op calls a step fewer), this composition elsewhere; equal scores may come in another order."""
    kernels = ops.fused_cpu_kernels(logits, bias, beam_lp)
    B, Wt, M = logits.shape
    K = min(width, Wt * M)
    if kernels is not None:
        out = (torch.empty(B, K), *(torch.empty(B, K, dtype=torch.long) for _ in range(3)))
        kids_np = np.zeros((0, 0, 0), np.int64) if kids is None else kids.contiguous().numpy()
        kernels.select_beams(logits.contiguous().numpy(), bias.contiguous().numpy(), beam_lp.contiguous().numpy(), kids_np,
                             prefix.contiguous().numpy(), codebook.child(t).numpy(), *(o.numpy() for o in out))
        return out
    scores = torch.log_softmax(logits + bias, dim=-1).add_(beam_lp[:, :, None]).reshape(B, Wt * M)
    beam_lp, idx = torch.topk(scores, K, dim=1)  # sorted, best first
    parent = idx // M
    code = idx % M if kids is None else torch.gather(kids.reshape(B, Wt * M), 1, idx)
    alive = beam_lp > NEG_INF
    prefix = codebook.advance(torch.gather(prefix, 1, parent), code, t)
    return beam_lp, parent, torch.where(alive, code, -1), torch.where(alive, prefix, -1)


@torch.no_grad()
def generate(decoder, codebook, states: torch.Tensor, lengths: torch.Tensor, options: DecodeOptions) -> BeamResult:
    """states [B, N, D] history states (left-aligned), lengths [B] (>= 1) -> top-W items per user."""
    if tuple(decoder.sizes) != codebook.codebook_sizes:
        raise ValueError(f"decoder code sizes {decoder.sizes} != codebook sizes {codebook.codebook_sizes}")
    W = options.beam_width
    B = states.shape[0]
    T = decoder.num_steps
    dev = states.device
    lengths = lengths.to(dev).long()
    policy = attention_policy(decoder, states, lengths, options).prepare()  # what the beams attend over
    user_state = states[torch.arange(B, device=dev), (lengths - 1).clamp_min(0)]  # [B, D] last state

    # one start beam per user
    prefix = torch.zeros(B, 1, dtype=torch.long, device=dev)  # level-t prefix ids (-1 = dead)
    beam_lp = torch.zeros(B, 1, device=dev)
    prefix_emb = torch.zeros(B, 1, decoder.d_model, device=dev, dtype=states.dtype)
    codes = torch.zeros(B, 1, 0, dtype=torch.long, device=dev)

    for t in range(T):
        x, q = decoder.query(user_state, prefix_emb, t)  # [B, Wt, D], [B, Wt, H, dh]
        Wt = q.shape[1]
        attn = policy.attend(t, q, beam_lp)  # [B, Wt, H, dh] over this step's rows of the history

        # the codes that continue an existing item (a live prefix always has one): [B, Wt, M]
        # lists where the level's lists are short, else all C_t codes with -inf on the others
        kids, bias = codebook.continuations(prefix, t)
        blocks = decoder.node_blocks(t, codebook)
        nodes = codebook.next_prefixes(prefix, t, kids) if decoder.has_node_output(t) and blocks is None else None
        parents = (prefix, blocks) if blocks is not None else None
        logits = decoder.head(x, attn, t, codes=kids, nodes=nodes, parents=parents)  # [B, Wt, M]
        beam_lp, parent, code, prefix = select_beams(logits.float(), bias, beam_lp, kids, prefix, codebook, t, W)
        codes = torch.cat([ops.gather_rows(codes, parent), code[:, :, None]], dim=2)
        if t + 1 < T:  # reorder per-beam state by parent (ops.gather_rows: x [B, W_old, ...] -> [B, W_new, ...])
            prefix_emb = ops.gather_rows(prefix_emb, parent) + decoder.code_embedding(code, t)
            policy.reorder(parent)

    items = codebook.items_of(prefix)
    codes = codes.masked_fill((beam_lp == NEG_INF)[:, :, None], -1)  # dead beams name no item
    if items.shape[1] < W:  # fewer candidates than beams (tiny codebooks)
        pad = W - items.shape[1]
        items = torch.cat([items, items.new_zeros(B, pad)], 1)
        codes = torch.cat([codes, codes.new_full((B, pad, T), -1)], 1)
        beam_lp = torch.cat([beam_lp, beam_lp.new_full((B, pad), NEG_INF)], 1)
    return BeamResult(item_ids=items, codes=codes, log_probs=beam_lp, attention=policy.records)
