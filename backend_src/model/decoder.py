"""Semantic-ID decoder (PFA: Attention Can Be Progressively Focused in Long-Sequence Generative
Recommendation): beams query the user's history with softmax cross-attention.

Every decoding step t = 0..3 has its own K/V projection of the history states (one shared
pair when cfg.shared_kv_projection), computed once before decoding. The query of a beam at step
t comes from the user's last history state, the embeddings of the codes generated so far and a
step embedding; the attention output goes through a head to logits over the C_t codes of level t.

With node output (cfg.node_output_sizes), step t also scores each candidate code by a learned
vector of the level-(t+1) prefix it would make: logit(c | p) = w_c . h + e_{p.c} . h. The head's
code vectors w_c are shared by every parent p, so alone they can tell items under one prefix apart
only through the query; a vector per prefix gives the last steps, where a prefix is nearly an item
(Beauty: 7,916 two-code prefixes for 12,101 items), an item's own collaborative vector as the
dense retrieval of "Self-Attentive Sequential Recommendation" has, inside the generative order.

The history rows are projected without their biases: the key bias b_k shifts all of a query's
logits by the same q.b_k (it cancels in the softmax) and the value bias b_v adds b_v to every
output (the weights sum to 1), so ``head`` adds b_v once per query instead of once per row.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from backend_src import ops
from backend_src.model.dropout import Dropout
from backend_src.ops.reference import row_mask


class _StepLayers(NamedTuple):
    q_proj: nn.Linear
    o_proj: nn.Linear
    mlp_norm: nn.LayerNorm
    mlp: nn.Sequential
    out_norm: nn.LayerNorm
    out: nn.Linear
    kv_proj: nn.Linear


# node output by parent blocks (SemanticIdDecoder.node_blocks) scores every prefix of a level for
# every user: cheaper than a gather per (beam, code) while the level has few prefixes (Amazon
# Beauty: 256 at step 1, 7,678 at step 2)
NODE_BLOCK_MAX_PARENTS = 1024


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


class SemanticIdDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.sizes = tuple(int(c) for c in cfg.codebook_sizes)
        self.num_steps = len(self.sizes)
        d, h = cfg.d_model, cfg.decoder_heads
        if d % h:
            raise ValueError(f"d_model {d} must be divisible by decoder_heads {h}")
        self.d_model, self.num_heads, self.head_dim = d, h, d // h
        self.shared_kv_projection = bool(cfg.shared_kv_projection)
        self._blocks = {}  # step -> (the codebook's child table, the weights' version, node_blocks)
        num_kv = 1 if self.shared_kv_projection else self.num_steps
        self.kv_proj = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(num_kv))
        # codes of levels 0..T-2 feed later queries; one table per level
        self.code_emb = nn.ModuleList(nn.Embedding(c, d) for c in self.sizes[:-1])
        self.step_emb = nn.Embedding(self.num_steps, d)
        self.q_norm = nn.LayerNorm(d)
        self.q_proj = nn.ModuleList(nn.Linear(d, d) for _ in range(self.num_steps))
        self.o_proj = nn.ModuleList(nn.Linear(d, d) for _ in range(self.num_steps))
        self.mlp_norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(self.num_steps))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), Dropout(cfg.dropout), nn.Linear(2 * d, d))
            for _ in range(self.num_steps)
        )
        self.out_norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(self.num_steps))
        self.out = nn.ModuleList(nn.Linear(d, c) for c in self.sizes)
        # a vector per level-(t+1) prefix where step t has node output; the extra last row, which
        # prefix id -1 (no item) indexes, stays zero (padding_idx: no gradient)
        nodes = tuple(int(n) for n in getattr(cfg, "node_output_sizes", ())) or (0,) * self.num_steps
        if len(nodes) != self.num_steps:
            raise ValueError(f"node_output_sizes {nodes} must name one size per step ({self.num_steps})")
        self.node_emb = nn.ModuleDict({str(t): nn.Embedding(n + 1, d, padding_idx=n) for t, n in enumerate(nodes) if n})
        for emb in self.node_emb.values():
            nn.init.normal_(emb.weight, std=0.02)
            emb.weight.data[-1].zero_()
        for emb in self.code_emb:
            nn.init.normal_(emb.weight, std=0.02)
        nn.init.normal_(self.step_emb.weight, std=0.02)
        # each step's layers, looked up once: query and head call their weights directly (a beam
        # search makes ~11 such calls a step; module dispatch was ~7% of a served decode)
        self._steps = [
            _StepLayers(self.q_proj[t], self.o_proj[t], self.mlp_norm[t], self.mlp[t], self.out_norm[t], self.out[t],
                        self.kv_proj[0 if self.shared_kv_projection else t])
            for t in range(self.num_steps)
        ]

    # ---- history side: computed once per request --------------------------------------------
    def project_history(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """states [B, N, D] -> K, V [T, B, N, H, dh] (without biases): one projection per
        decoding step (a single one broadcast over the steps when shared)."""
        B, N, _ = states.shape
        # all steps' projections as one matmul: [B, N, P * 2D], P = 1 (shared) or T
        weight = torch.cat([p.weight for p in self.kv_proj])
        kv = F.linear(states, weight).view(B, N, len(self.kv_proj), 2, self.num_heads, self.head_dim)
        kv = kv.permute(3, 2, 0, 1, 4, 5)  # [2, P, B, N, H, dh]
        k, v = kv[0].contiguous(), kv[1].contiguous()  # each step reads its block contiguously
        if self.shared_kv_projection:
            shape = (self.num_steps, B, N, self.num_heads, self.head_dim)
            k, v = k.expand(shape), v.expand(shape)
        return k, v

    def project_step(self, states: torch.Tensor, step: int, part: str = "kv"):
        """states [B, N, D] -> K_t, V_t [B, N, H, dh] of one decoding step (without biases), or
        only K_t (part "k") or V_t (part "v"). Row-wise, so projecting gathered rows equals
        gathering projected rows: PFA projects keys of every row for its selection, values only
        for the rows it keeps, and the later steps only for their k_t rows."""
        weight = self.kv_proj[0 if self.shared_kv_projection else step].weight  # [2D, D]: W_k; W_v
        rows = {"kv": weight, "k": weight[: self.d_model], "v": weight[self.d_model :]}[part]
        out = F.linear(states, rows).view(*states.shape[:2], len(part), self.num_heads, self.head_dim)
        return out[:, :, 0] if len(part) == 1 else (out[:, :, 0], out[:, :, 1])

    def attend_states(
        self, q: torch.Tensor, states: torch.Tensor, lengths: torch.Tensor, step: int
    ) -> torch.Tensor:
        """Softmax attention of q [B, M, H, dh] over step `step`'s K/V of the first lengths[b]
        rows of states [B, N, D], without projecting the rows: with the unbiased k_j = W_k x_j and
        v_j = W_v x_j (see the module docstring),  q.k_j = (W_k^T q).x_j  and
        sum_j p_j v_j = W_v (sum_j p_j x_j).
        Costs ~4 M H N D multiply-adds instead of the projection's 2 N D^2, so it is the
        cheaper path while M H < D / 2 (step 0, where every user has one beam) -> [B, M, H, dh]."""
        p = self.kv_proj[0 if self.shared_kv_projection else step]
        H, dh, D = self.num_heads, self.head_dim, self.d_model
        w_k, w_v = p.weight[:D].view(H, dh, D), p.weight[D:].view(H, dh, D)
        q_states = torch.einsum("bmhe,hed->bmhd", q, w_k) * dh**-0.5  # [B, M, H, D]
        logits = torch.einsum("bmhd,bnd->bmhn", q_states, states)
        valid = row_mask(lengths, states.shape[1])
        probs = torch.softmax(logits.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
        pooled = torch.einsum("bmhn,bnd->bmhd", probs, states)  # [B, M, H, D]
        return torch.einsum("bmhd,hed->bmhe", pooled, w_v)

    # ---- query side ----------------------------------------------------------------------------
    def code_embedding(self, codes: torch.Tensor, level: int) -> torch.Tensor:
        """codes [...] of level `level` -> [..., D] (codes < 0 embed to zero)."""
        table = F.pad(self.code_emb[level].weight, (0, 0, 0, 1))  # + a zero row, which -1 indexes
        return F.embedding(codes % table.shape[0], table)

    def query(self, user_state: torch.Tensor, prefix_emb: torch.Tensor, step: int):
        """user_state [B, D] or [B, M, D] (broadcast over beams), prefix_emb [B, M, D] = sum of the
        embeddings of the codes generated so far -> (x [B, M, D] query input, q [B, M, H, dh])."""
        if user_state.dim() == 2:
            user_state = user_state[:, None, :]
        x = user_state + prefix_emb + self.step_emb.weight[step]
        q = _linear(_layer_norm(x, self.q_norm), self._steps[step].q_proj)
        return x, q.view(*q.shape[:-1], self.num_heads, self.head_dim)

    def has_node_output(self, step: int) -> bool:
        return str(step) in self.node_emb

    def add_node_scores(self, logits: torch.Tensor, h: torch.Tensor, nodes: torch.Tensor, step: int,
                        columns: torch.Tensor | None = None) -> torch.Tensor:
        """logits [..., C] + e_n . h at every slot whose node n >= 0: h [..., D] the head's normalized
        output, nodes [..., K] level-(t+1) prefix ids (-1 = none), slot k's column in logits
        columns[..., k] (default k).

        On the CPU only the slots that name a prefix are computed: most are pads (on Amazon Beauty
        1.4 of 15 codes continue a level-2 prefix, 1.1 of 46 the last), and a D-vector gathered per
        slot was most of node output's cost. The GPU's path gathers every slot: static shapes, no
        host read sizing the pairs, so a CUDA graph captures the decode."""
        emb = self.node_emb[str(step)]
        if ops.backend_for(h) != "torch":
            vectors = F.embedding(nodes % emb.num_embeddings, emb.weight, padding_idx=emb.padding_idx)  # -1: zero row
            dots = torch.matmul(vectors, h[..., None])[..., 0]
            return logits + dots if columns is None else logits.scatter_add(-1, columns, dots)
        K = nodes.shape[-1]
        flat = nodes.reshape(-1)
        pairs = (flat >= 0).nonzero().squeeze(1)
        row = pairs // K
        dots = (F.embedding(flat[pairs], emb.weight) * h.reshape(-1, h.shape[-1]).index_select(0, row)).sum(-1)
        col = pairs - row * K if columns is None else columns.reshape(-1)[pairs]
        return logits.reshape(-1).index_add(0, row * logits.shape[-1] + col, dots).view(logits.shape)

    def node_blocks(self, step: int, codebook) -> torch.Tensor | None:
        """[P_t + 1, M_t, D]: each level-t prefix's block of node vectors, one per entry of its kids
        table (zero for pads and the dead last row), where step t has node output and the level
        has a kids table and at most NODE_BLOCK_MAX_PARENTS prefixes, else None. Derived from the
        weights and kept until they change."""
        if not self.has_node_output(step):
            return None
        child = codebook.child(step)
        if child.shape[0] + 1 > NODE_BLOCK_MAX_PARENTS:
            return None
        weight = self.node_emb[str(step)].weight
        key = (weight.data_ptr(), weight._version)
        cached = self._blocks.get(step)
        if cached is None or cached[0] is not child or cached[1] != key:  # the entry holds child: its identity is safe
            kid_nodes = codebook.kid_prefixes(step)
            with torch.no_grad():  # -1 indexes the last, zero, row
                blocks = None if kid_nodes is None else F.embedding(kid_nodes % weight.shape[0], weight)
            self._blocks[step] = cached = (child, key, blocks)
        return cached[2]

    @staticmethod
    def node_scores_by_parent(h: torch.Tensor, parents: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """h [B, W, D], parents [B, W] the beams' level-t prefix ids (a user's live beams hold
        distinct ones; -1 dead), blocks [P_t + 1, M_t, D] (node_blocks) -> e . h [B, W, M_t] of
        each beam's kids. Every prefix's block is scored against every user's beam on it as one
        batched matrix product (a zero row where a user has no beam there): no D-vector is gathered
        per (beam, code), which at 16 users a call cost more than the rest of the decode."""
        B, W, D = h.shape
        rows = parents % blocks.shape[0]  # -1 -> the dead row, whose block is zero
        users = torch.arange(B, device=h.device)[:, None].expand(B, W)
        by_prefix = h.new_zeros(blocks.shape[0], B, D)
        by_prefix[rows, users] = h
        return torch.bmm(by_prefix, blocks.transpose(1, 2))[rows, users]  # [P + 1, B, M] -> [B, W, M]

    def head(self, x: torch.Tensor, attn: torch.Tensor, step: int, codes: torch.Tensor | None = None,
             nodes: torch.Tensor | None = None, parents: tuple | None = None) -> torch.Tensor:
        """x [B, M, D] query input, attn [B, M, H, dh] attention output over unbiased values
        -> logits [B, M, C_t] over all codes, or [B, M, K] of codes [B, M, K] only. Where step t
        has node output, either nodes: the level-(t+1) prefix ids of those codes
        (SemanticIdCodebook.next_prefixes), or parents: (the beams' level-t prefix ids, node_blocks)
        when the codes are the level's kids table (SemanticIdCodebook.continuations)."""
        return self.code_logits(self.head_state(x, attn, step), step, codes, nodes, parents)

    def logit_tables(self, step: int) -> tuple:
        """(w [C_t, D], b [C_t], node vectors [N + 1, D] or None): what code_logits reads at `step`."""
        out = self._steps[step].out
        return out.weight, out.bias, self.node_emb[str(step)].weight if self.has_node_output(step) else None

    def code_logits(self, h: torch.Tensor, step: int, codes: torch.Tensor | None = None, nodes: torch.Tensor | None = None,
                    parents: tuple | None = None) -> torch.Tensor:
        """The head's logits (see `head`) read from its normalized output h [B, M, D]:
        logit(c | p) = w_c . h + b_c [+ e_{p.c} . h]."""
        logits = _linear(h, self._steps[step].out)
        logits = logits if codes is None else torch.gather(logits, -1, codes)
        if self.has_node_output(step):
            if parents is not None:
                logits = logits + self.node_scores_by_parent(h, *parents)
            elif nodes is not None:
                logits = self.add_node_scores(logits, h, nodes, step)
            else:
                raise ValueError(f"decoding step {step} has node output: pass the codes' next prefix ids")
        return logits

    def head_state(self, x: torch.Tensor, attn: torch.Tensor, step: int) -> torch.Tensor:
        """The normalized output h [B, M, D] the code logits are read from."""
        s = self._steps[step]
        b_v = s.kv_proj.bias[self.d_model:]
        z = x + _linear(attn.reshape(*attn.shape[:-2], self.d_model) + b_v, s.o_proj)
        # s.mlp is Linear, GELU, Dropout, Linear
        h = F.gelu(_linear(_layer_norm(z, s.mlp_norm), s.mlp[0]), approximate=s.mlp[1].approximate)
        z = z + _linear(s.mlp[2](h) if self.training else h, s.mlp[3])
        return _layer_norm(z, s.out_norm)

    # ---- training: teacher forcing at every history position -------------------------------------
    def training_logits(
        self, states: torch.Tensor, lengths: torch.Tensor, target_codes: torch.Tensor, codebook=None,
        valid: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """states [B, N, D], lengths [B], target_codes [B, N, 4] (codes of the item following
        each position; -1 where none) -> [logits [B, N, C_t] for t = 0..3], or [P, C_t] of the P
        positions of the mask `valid` [B, N] only (the head then runs on those rows alone).

        The query at position i uses h_i as its user state and the target's first t codes as its
        prefix, and attends (softmax, causal) to history rows j <= i. Positions past lengths[b]
        produce values the loss must ignore. With node output, `codebook` gives the prefixes: a
        code's node term is added where the code continues the target's prefix to an item (the
        codes beam search scores), the others keep their code logit alone.
        """
        B, N, _ = states.shape
        K, V = self.project_history(states)  # [T, B, N, H, dh]
        causal = torch.ones(N, N, dtype=torch.bool, device=states.device).tril()  # [i, j]: j <= i
        scale = self.head_dim**-0.5
        prefix = torch.zeros_like(states)
        rows = (lambda a: a[valid]) if valid is not None else (lambda a: a)
        prefixes = codebook.level_prefixes(rows(target_codes)) if len(self.node_emb) else None  # [.., L + 1]
        out = []
        for t in range(self.num_steps):
            x, q = self.query(states, prefix, t)  # [B, N, D], [B, N, H, dh]
            logits = torch.einsum("bihd,bjhd->bhij", q, K[t]) * scale
            probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            attn = torch.einsum("bhij,bjhd->bihd", probs, V[t])
            h = self.head_state(rows(x), rows(attn), t)
            logits = _linear(h, self._steps[t].out)
            if self.has_node_output(t):
                kids, _ = codebook.continuations(prefixes[..., t], t)
                # the codes that continue the prefix: all of the level's, or its kids (a pad continues none)
                logits = self.add_node_scores(logits, h, codebook.next_prefixes(prefixes[..., t], t, kids), t, kids)
            out.append(logits)
            if t + 1 < self.num_steps:
                prefix = prefix + self.code_embedding(target_codes[..., t], t)
        return out

    def training_loss(
        self, states: torch.Tensor, lengths: torch.Tensor, target_codes: torch.Tensor, codebook=None
    ) -> torch.Tensor:
        """Mean over valid positions (target code >= 0) and steps of the code cross-entropy."""
        logits = self.training_logits(states, lengths, target_codes, codebook)
        losses = [
            F.cross_entropy(lg.reshape(-1, lg.shape[-1]), target_codes[..., t].reshape(-1), ignore_index=-1)
            for t, lg in enumerate(logits)
        ]
        return torch.stack(losses).mean()
