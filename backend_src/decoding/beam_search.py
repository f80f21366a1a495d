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
from typing import NamedTuple

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


class Beams(NamedTuple):
    """Each user's beams after a step t: [B, W] scores (log-probabilities, -inf = dead) and level-(t+1)
    prefix ids (-1 = dead), [B, W, t + 1] codes (-1 = dead) and [B, W, D] the sum of their codes'
    embeddings (what the next query reads; None after the last step)."""

    lp: torch.Tensor
    prefix: torch.Tensor
    codes: torch.Tensor
    prefix_emb: torch.Tensor | None


def expand_beams(decoder, codebook, t: int, h: torch.Tensor, beams: Beams, width: int) -> tuple[Beams, torch.Tensor]:
    """Step t after the head: each live beam's continuations scored from the head's output h
    [B, Wt, D] (decoder.code_logits, only the codes that continue an existing item), log-softmax
    over them + the beam's score, the best min(width, Wt M) of a user's (best first), and the beams
    they make -> (Beams, parent [B, W]: the beam each extends). One compiled call on the CPU
    (cpu_kernels.expand_beams: ~40 op calls a step fewer); this composition elsewhere (equal
    scores may come in another order)."""
    last = t + 1 == decoder.num_steps
    kernels = ops.fused_cpu_kernels(h, beams.lp)
    if kernels is not None:
        return _expand_compiled(kernels, decoder, codebook, t, h, beams, width, last)
    kids, bias = codebook.continuations(beams.prefix, t)  # [B, Wt, M]
    blocks = decoder.node_blocks(t, codebook)
    nodes = codebook.next_prefixes(beams.prefix, t, kids) if decoder.has_node_output(t) and blocks is None else None
    parents = (beams.prefix, blocks) if blocks is not None else None
    logits = decoder.code_logits(h, t, codes=kids, nodes=nodes, parents=parents)  # [B, Wt, M]
    B, Wt, M = logits.shape
    scores = torch.log_softmax(logits.float() + bias, dim=-1).add_(beams.lp[:, :, None]).reshape(B, Wt * M)
    lp, idx = torch.topk(scores, min(width, Wt * M), dim=1)  # sorted, best first
    parent = idx // M
    code = idx % M if kids is None else torch.gather(kids.reshape(B, Wt * M), 1, idx)
    alive = lp > NEG_INF
    prefix = torch.where(alive, codebook.advance(torch.gather(beams.prefix, 1, parent), code, t), -1)
    code = torch.where(alive, code, -1)
    codes = torch.cat([ops.gather_rows(beams.codes, parent), code[:, :, None]], dim=2)
    # per-beam state follows its parent (ops.gather_rows: x [B, W_old, ...] -> [B, W_new, ...])
    prefix_emb = None if last else ops.gather_rows(beams.prefix_emb, parent) + decoder.code_embedding(code, t)
    return Beams(lp, prefix, codes, prefix_emb), parent


def _expand_compiled(kernels, decoder, codebook, t, h, beams, width, last):
    kids = getattr(codebook, f"kids_{t}")
    cont_bias = getattr(codebook, f"bias_{t}") if kids is None else getattr(codebook, f"kid_bias_{t}")
    B, Wt, D = h.shape
    K = min(width, Wt * cont_bias.shape[1])
    out_w, out_b, node_emb = decoder.logit_tables(t)
    new = Beams(torch.empty(B, K), torch.empty(B, K, dtype=torch.long), torch.empty(B, K, t + 1, dtype=torch.long),
                None if last else torch.empty(B, K, D))
    parent = torch.empty(B, K, dtype=torch.long)
    none = np.zeros((0, 0), np.int64)
    arr = lambda x: x.detach().contiguous().numpy()  # noqa: E731 - the kernel's arguments as numpy
    kernels.expand_beams(
        arr(h), arr(out_w), arr(out_b), none if kids is None else arr(kids), arr(cont_bias), arr(codebook.child(t)),
        np.zeros((0, D), np.float32) if node_emb is None else arr(node_emb), arr(beams.lp), arr(beams.prefix), arr(beams.codes),
        np.zeros((0, 0, 0), np.float32) if last else arr(beams.prefix_emb),
        np.zeros((0, 0), np.float32) if last else arr(decoder.code_emb[t].weight),
        new.lp.numpy(), parent.numpy(), new.prefix.numpy(), new.codes.numpy(),
        np.zeros((0, 0, 0), np.float32) if last else new.prefix_emb.numpy())
    return new, parent


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
    beams = Beams(lp=torch.zeros(B, 1, device=dev), prefix=torch.zeros(B, 1, dtype=torch.long, device=dev),
                  codes=torch.zeros(B, 1, 0, dtype=torch.long, device=dev),
                  prefix_emb=torch.zeros(B, 1, decoder.d_model, device=dev, dtype=states.dtype))
    for t in range(T):
        x, q = decoder.query(user_state, beams.prefix_emb, t)  # [B, Wt, D], [B, Wt, H, dh]
        attn = policy.attend(t, q, beams.lp)  # [B, Wt, H, dh] over this step's rows of the history
        beams, parent = expand_beams(decoder, codebook, t, decoder.head_state(x, attn, t), beams, W)
        if t + 1 < T:
            policy.reorder(parent)  # per-beam attention state follows its parent

    beam_lp, prefix, codes = beams.lp, beams.prefix, beams.codes
    items = codebook.items_of(prefix)
    codes = codes.masked_fill((beam_lp == NEG_INF)[:, :, None], -1)  # dead beams name no item
    if items.shape[1] < W:  # fewer candidates than beams (tiny codebooks)
        pad = W - items.shape[1]
        items = torch.cat([items, items.new_zeros(B, pad)], 1)
        codes = torch.cat([codes, codes.new_full((B, pad, T), -1)], 1)
        beam_lp = torch.cat([beam_lp, beam_lp.new_full((B, pad), NEG_INF)], 1)
    return BeamResult(item_ids=items, codes=codes, log_probs=beam_lp, attention=policy.records)
