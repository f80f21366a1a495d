"""HSTU backbone (Actions Speak Louder than Words: Trillion-Parameter Sequential Transducers for
Generative Recommendations, section 3) with a per-layer K/V cache and incremental append.

One HSTU layer:
    U, V, Q, K = split(silu(f1(LayerNorm(x))))
    A = silu(Q K^T * scale + rab_pos + rab_time) / N          (causal, no softmax)
    y = x + f2(dropout(LayerNorm(A V) * U))                   (no FFN)
The divisor N is the fixed ``cfg.max_seq_len``, not the number of visible rows, so a row's
output depends only on the rows before it: encoding a sequence in two parts (``append``) gives
the same states and K/V as encoding it at once (``forward``).

Batches are left-aligned: user b's events are rows 0..lengths[b]-1, row i sits at position i.
Padding rows never influence valid rows; the cache stores zeros in them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from backend_src import ops
from backend_src.config import ModelConfig
from backend_src.model.dropout import Dropout
from backend_src.ops.reference import row_mask


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------
def _rows_shape(t: torch.Tensor, row_dim: int, n: int) -> list:
    """t's shape with n rows in dimension row_dim."""
    shape = list(t.shape)
    shape[row_dim] = n
    return shape


@dataclass
class HistoryCache:
    """What the encoder keeps per user (batched, left-aligned padded; rows >= lengths[b] are 0)."""

    keys: torch.Tensor  # [L, B, N, H, dqk] per-layer keys of history rows
    values: torch.Tensor  # [L, B, N, H, dv]
    states: torch.Tensor  # [B, N, D] final (normalized) states of history rows
    timestamps: torch.Tensor  # [B, N] long
    lengths: torch.Tensor  # [B] long

    # ---- shape helpers ------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_rows(self) -> int:
        """N, the padded row count (>= max(lengths))."""
        return self.states.shape[1]

    @property
    def device(self) -> torch.device:
        return self.states.device

    def last_states(self) -> torch.Tensor:
        """[B, D] each history's last final state (what the dense head scores items against)."""
        return self.states[torch.arange(self.batch_size, device=self.device), (self.lengths - 1).clamp_min(0)]

    def _map(self, fn) -> "HistoryCache":
        """Apply fn(name, tensor) to every field."""
        return HistoryCache(**{f.name: fn(f.name, getattr(self, f.name)) for f in fields(self)})

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def empty(
        cls,
        cfg: ModelConfig,
        batch_size: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> "HistoryCache":
        """A cache of `batch_size` users with no history (N = 0); `append` fills it."""
        L, H, D = cfg.num_layers, cfg.num_heads, cfg.d_model
        d = D // H
        return cls(
            keys=torch.zeros(L, batch_size, 0, H, d, device=device, dtype=dtype),
            values=torch.zeros(L, batch_size, 0, H, d, device=device, dtype=dtype),
            states=torch.zeros(batch_size, 0, D, device=device, dtype=dtype),
            timestamps=torch.zeros(batch_size, 0, device=device, dtype=torch.long),
            lengths=torch.zeros(batch_size, device=device, dtype=torch.long),
        )

    # ---- row (user) selection and padding ----------------------------------------------
    def select(self, rows) -> "HistoryCache":
        """The users `rows` (index tensor, list or slice) of this batch, in that order."""
        if not isinstance(rows, slice):
            rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        return self._map(lambda name, t: t[:, rows] if name in ("keys", "values") else t[rows])

    def resize(self, n: int) -> "HistoryCache":
        """Pad with zero rows or cut padding so that N = n (n must be >= max(lengths))."""
        cur = self.num_rows
        if n == cur:
            return self
        if n < cur:
            return self._map_rows(lambda t, d: t.narrow(d, 0, n))
        return self._map_rows(lambda t, d: torch.cat([t, t.new_zeros(_rows_shape(t, d, n - cur))], dim=d))

    def trim(self) -> "HistoryCache":
        """Drop padding rows past the longest history."""
        return self.resize(int(self.lengths.max()) if self.batch_size else 0)

    @classmethod
    def cat(cls, caches: Sequence["HistoryCache"]) -> "HistoryCache":
        """Stack caches (e.g. one per user, as a session store keeps them) into one batch."""
        if len(caches) == 0:
            raise ValueError("HistoryCache.cat needs at least one cache")
        n = max(c.num_rows for c in caches)
        caches = [c.resize(n) for c in caches]
        return HistoryCache(
            **{
                f.name: torch.cat([getattr(c, f.name) for c in caches], dim=1 if f.name in ("keys", "values") else 0)
                for f in fields(cls)
            }
        )

    def split(self) -> list["HistoryCache"]:
        """One single-user cache per batch row, each cut to its own length (the inverse of cat)."""
        out = []
        for b, n in enumerate(self.lengths.tolist()):  # a list per user is the result itself
            out.append(self.select(slice(b, b + 1)).resize(n))
        return out

    # ---- spare capacity (in-place append) ----------------------------------------------
    # Rows of a tensor's buffer past its view are spare capacity: `append(in_place=True)` writes
    # the new rows there instead of copying the old ones into fresh tensors. The row dimension
    # is 2 for keys/values [L, B, N, ...], 1 for the others; a view's capacity is read off the
    # stride of the dimension above the rows, so a user's view inside a batch buffer never
    # reaches into the next user's rows.
    @staticmethod
    def _row_dim(name: str) -> int:
        return 2 if name in ("keys", "values") else 1

    def _map_rows(self, fn) -> "HistoryCache":
        """Apply fn(tensor, row_dim) to every per-row field (lengths stay)."""
        return self._map(lambda name, t: t if name == "lengths" else fn(t, self._row_dim(name)))

    def capacity(self) -> int:
        """Rows every tensor's buffer holds for each user (>= num_rows)."""
        buffer_rows = self.__dict__.get("_buffer_rows")  # known for views from grown()
        if buffer_rows is None:
            buffer_rows = self._buffer_rows = self._count_buffer_rows()
        return max(self.num_rows, buffer_rows)

    def _count_buffer_rows(self) -> int:
        caps = []
        for f in fields(self):
            if f.name == "lengths":
                continue
            t, d = getattr(self, f.name), self._row_dim(f.name)
            row = t.stride(d)
            inner = sum((s - 1) * st for s, st in zip(t.shape[d + 1:], t.stride()[d + 1:])) + 1  # one row's span
            cap = t.stride(d - 1) // row if row >= inner else 0
            # the buffer must really extend that far (a last user's view ends at the storage end)
            extent = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s) + 1
            extent += (cap - t.shape[d]) * row
            caps.append(cap if t.numel() and extent * t.element_size() <= t.untyped_storage().nbytes() else t.shape[d])
        return min(caps)

    def reserve(self, capacity: int) -> "HistoryCache":
        """The same cache in fresh buffers of `capacity` rows (zero past num_rows)."""
        capacity = max(int(capacity), self.num_rows)
        return self._map_rows(lambda t, d: t.new_zeros(_rows_shape(t, d, capacity)).narrow(d, 0, t.shape[d]).copy_(t))

    def grown(self, n: int) -> "HistoryCache":
        """Views of the first n rows of this cache's buffers (n <= capacity()); rows past
        num_rows are whatever the buffer holds there (the caller writes them)."""
        views = self._map_rows(lambda t, d: t.as_strided(_rows_shape(t, d, n), t.stride(), t.storage_offset()))
        views._buffer_rows = self.capacity()  # the same buffers
        return views

    # ---- device / bookkeeping -----------------------------------------------------------
    def to(self, device=None, dtype: torch.dtype | None = None) -> "HistoryCache":
        """Move to `device`; `dtype` (if given) applies to the float tensors only."""
        return self._map(
            lambda name, t: t.to(device=device, dtype=dtype if (dtype is not None and t.is_floating_point()) else None)
        )

    def detach(self) -> "HistoryCache":
        return self._map(lambda name, t: t.detach())

    def clone(self) -> "HistoryCache":
        return self._map(lambda name, t: t.clone())

    def num_bytes(self) -> int:
        """Memory held by the tensors, spare rows included (for the session store's bound)."""
        rows = self.num_rows
        scale = self.capacity() / rows if rows else 1.0
        return int(sum(
            getattr(self, f.name).numel() * getattr(self, f.name).element_size() * (1.0 if f.name == "lengths" else scale)
            for f in fields(self)
        ))


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
_PARAMETER_REGISTRATIONS = [0]  # parameters registered by any module so far (see _fused_weights)


def _count_registration(module, name, param):
    _PARAMETER_REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def merge_rows(
    old: torch.Tensor, new: torch.Tensor, lengths: torch.Tensor, new_lengths: torch.Tensor, n_out: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Left-aligned concatenation per user, vectorized: out[b, j] = old[b, j] for j < lengths[b],
    new[b, j - lengths[b]] for lengths[b] <= j < lengths[b] + new_lengths[b], 0 after.

    old [B, No, ...] (No >= max(lengths)), new [B, Nn, ...] -> [B, n_out, ...], written into
    `out` when given (e.g. one layer's slice of the stacked cache, saving a copy).
    """
    if out is not None and torch.is_grad_enabled() and (old.requires_grad or new.requires_grad):
        return out.copy_(merge_rows(old, new, lengths, new_lengths, n_out))  # out= is not differentiable
    B, No = old.shape[:2]
    Nn = new.shape[1]
    if n_out == No + Nn and bool((lengths == No).all()) and bool((new_lengths == Nn).all()):
        # no padding anywhere (always so for one user): the plain concatenation
        return torch.cat([old, new], dim=1) if out is None else torch.cat([old, new], dim=1, out=out)
    both = torch.cat([old, new], dim=1)  # [B, No + Nn, ...]
    j = torch.arange(n_out, device=old.device)[None, :]  # [1, n_out]
    from_old = j < lengths[:, None]
    src = torch.where(from_old, j, No + (j - lengths[:, None]).clamp(0, max(Nn - 1, 0)))  # [B, n_out]
    valid = j < (lengths + new_lengths)[:, None]
    if No + Nn == 0:
        return both.new_zeros((B, n_out) + tuple(both.shape[2:]))
    src = src.clamp(max=No + Nn - 1)
    idx = src.reshape(B, n_out, *([1] * (both.dim() - 2))).expand(B, n_out, *both.shape[2:])
    merged = torch.gather(both, 1, idx) if out is None else torch.gather(both, 1, idx, out=out)
    return merged.mul_(valid.reshape(B, n_out, *([1] * (both.dim() - 2))).to(merged.dtype))


def _check_length(longest: int, limit: int, what: str) -> None:
    if longest > limit:
        raise ValueError(
            f"{what}: {longest} events exceed max_seq_len={limit}; "
            f"re-encode the most recent {limit} events with forward() instead"
        )


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------
class HSTULayer(nn.Module):
    """One HSTU layer, split into its three steps so that the encoder (full and incremental)
    and the M-FALCON ranker can run the attention over different key sets:
    ``project`` (x -> U, Q, K, V), ``attend`` (the op), ``output`` (gate, f2, residual)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, H = cfg.d_model, cfg.num_heads
        if D % H:
            raise ValueError(f"d_model {D} must be divisible by num_heads {H}")
        self.num_heads = H
        self.dqk = self.dv = D // H
        self.norm = nn.LayerNorm(D)
        self.f1 = nn.Linear(D, 2 * H * self.dv + 2 * H * self.dqk)  # -> U, V, Q, K
        self.attn_norm = nn.LayerNorm(H * self.dv)
        self.f2 = nn.Linear(H * self.dv, D)
        self.dropout = Dropout(cfg.dropout)
        # rab^{p,t}: per-head bias by relative position (q_pos - k_pos) and log-bucketed |dt|
        self.pos_bias = nn.Parameter(torch.empty(H, cfg.max_seq_len).normal_(0.0, 0.02))
        self.time_bias = nn.Parameter(torch.empty(H, cfg.num_time_buckets).normal_(0.0, 0.02))
        self.time_base = cfg.time_bucket_base
        self.scale = 1.0 / math.sqrt(self.dqk)
        self.attn_divisor = float(cfg.max_seq_len)  # the fixed N of the HSTU paper

    def project(self, x: torch.Tensor):
        """x [B, M, D] -> U [B, M, H*dv], Q [B, M, H, dqk], K [B, M, H, dqk], V [B, M, H, dv]."""
        H, dv, dqk = self.num_heads, self.dv, self.dqk
        u, v, q, k = torch.split(F.silu(self.f1(self.norm(x))), [H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        B, M = x.shape[:2]
        return u, q.reshape(B, M, H, dqk), k.reshape(B, M, H, dqk), v.reshape(B, M, H, dv)

    def attend(self, q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self, shared=None) -> torch.Tensor:
        """A(X) V through the shared op (positional arguments: the op dispatches on them).
        shared: one dict for all layers of a pass (see ``ops.hstu_attention``)."""
        return ops.hstu_attention(
            q, k, v, q_pos, k_pos, q_ts, k_ts, num_history, q_self,
            self.pos_bias, self.time_bias, self.time_base, self.scale, self.attn_divisor, shared=shared,
        )

    def output(self, x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """y = x + f2(dropout(LayerNorm(A V) * U)); attn [B, M, H, dv]."""
        return x + self.f2(self.dropout(self.attn_norm(attn.flatten(-2)) * u))


class HSTUEncoder(nn.Module):
    """Token x_i = E_item[item_i] + E_action[action_i] (scaled by sqrt(D)), HSTU layers,
    final LayerNorm. ``forward`` encodes whole (left-aligned) sequences; ``append`` encodes
    only new events on top of a ``HistoryCache``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        # rows: 0 padding, 1..I the trained items, I + 1 the learned unknown item (an event naming an
        # item the model was not trained on: trained by hiding a share of the history's items)
        self.item_embedding = nn.Embedding(cfg.num_items + 2, D, padding_idx=0)
        self.action_embedding = nn.Embedding(cfg.num_actions, D)
        nn.init.trunc_normal_(self.item_embedding.weight, std=0.02)
        nn.init.trunc_normal_(self.action_embedding.weight, std=0.02)
        with torch.no_grad():
            self.item_embedding.weight[0].zero_()
        # Semantic-ID code embeddings (training only): items that share codes share part of their
        # vector, so an item seen a few times borrows from its neighbours in the semantic-ID space
        # (and from the side information its codes were fit on). The sum is linear in the tables,
        # so a checkpoint holds it folded into the item table (item_table) and serves as before.
        self.code_embedding = None
        if cfg.code_embedding_levels:
            L = cfg.code_embedding_levels
            rows = sum(int(c) for c in cfg.codebook_sizes[:L])
            self.code_embedding = nn.Embedding(rows + 1, D, padding_idx=rows)  # the last row: no code
            nn.init.trunc_normal_(self.code_embedding.weight, std=0.02)
            with torch.no_grad():
                self.code_embedding.weight[rows].zero_()
            self.register_buffer("item_code_rows", torch.full((cfg.num_items + 2, L), rows, dtype=torch.long))
        # the code embeddings a written checkpoint keeps beside its folded item table (code_vectors)
        self.register_buffer("catalog_code_embedding", torch.zeros(0, D))
        self.input_dropout = Dropout(cfg.dropout)
        self.layers = nn.ModuleList(HSTULayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(D)
        self.embed_scale = math.sqrt(D)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a checkpoint from before the unknown-item row: that row starts at zero (the event's
        # action, position and time still count)
        for name in ("item_embedding.weight", "item_code_rows"):
            old = state_dict.get(prefix + name)
            if old is not None and old.shape[0] == self.cfg.num_items + 1:
                fill = old[:1] if name == "item_code_rows" else torch.zeros_like(old[:1])
                state_dict[prefix + name] = torch.cat([old, fill])
        stored = state_dict.setdefault(prefix + "catalog_code_embedding", torch.zeros(0, self.cfg.d_model))
        self.catalog_code_embedding = torch.empty_like(stored)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def unknown_index(self) -> int:
        return self.cfg.num_items + 1

    def set_item_codes(self, codes: torch.Tensor) -> None:
        """codes [I + 1, levels] (the codebook's; row 0, padding, all -1): each item's rows of
        code_embedding, one per level (level t's codes after those of the levels before it); the
        unknown item's row has none."""
        L = self.cfg.code_embedding_levels
        sizes = torch.tensor([int(c) for c in self.cfg.codebook_sizes[:L]])
        offsets = torch.cumsum(sizes, 0) - sizes
        codes = codes[:, :L].cpu()
        rows = torch.where(codes >= 0, codes + offsets, int(sizes.sum()))
        self.item_code_rows[: rows.shape[0]].copy_(rows)

    def code_vectors(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [n, L] semantic IDs -> [n, D]: the sum of their code embeddings over the levels the
        model trained them for, the part of a trained item's vector its codes give (an item added
        to the catalog has no row of its own). The unknown item's vector where the model has none."""
        table = self.code_embedding.weight if self.code_embedding is not None else self.catalog_code_embedding
        levels = self.cfg.code_embedding_levels or self.cfg.catalog_code_levels
        if not levels or not table.numel():
            return self.item_embedding.weight[self.unknown_index].detach().expand(codes.shape[0], -1).clone()
        sizes = torch.tensor([int(c) for c in self.cfg.codebook_sizes[:levels]])
        offsets = (torch.cumsum(sizes, 0) - sizes).to(codes.device)
        return table.detach()[codes[:, :levels] + offsets].sum(1)

    def item_vectors(self, items: torch.Tensor) -> torch.Tensor:
        """[...] item ids -> [..., D]: E_item[item], plus its codes' embeddings while training with them."""
        e = self.item_embedding(items)
        if self.code_embedding is not None:
            e = e + self.code_embedding(self.item_code_rows[items]).sum(-2)
        return e

    def item_table(self) -> torch.Tensor:
        """[I + 2, D]: every item's vector (item_vectors of 0..I + 1; the item embedding's weight
        when there are no code embeddings)."""
        if self.code_embedding is None:
            return self.item_embedding.weight
        return self.item_embedding.weight + self.code_embedding(self.item_code_rows).sum(-2)

    def embed(self, items: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """[B, M] ids -> [B, M, D] input tokens (embeddings are small at init; sqrt(D) scaling
        brings them to unit scale next to the residual stream)."""
        return self.embed_vectors(self.item_vectors(items), actions)

    def embed_vectors(self, vectors: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """`embed` of items given by their vectors [B, M, D]."""
        return self.input_dropout((vectors + self.action_embedding(actions)) * self.embed_scale)

    # ---- full encode ------------------------------------------------------------------------
    def forward(
        self,
        items: torch.Tensor,  # [B, N] long, 0 = padding
        actions: torch.Tensor,  # [B, N] long
        timestamps: torch.Tensor,  # [B, N] long seconds
        lengths: torch.Tensor,  # [B] long
    ) -> HistoryCache:
        # data-dependent: skipped while tracing for export (shapes are fixed there)
        if lengths.numel() and not (torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()):
            _check_length(int(lengths.max()), self.cfg.max_seq_len, "forward")
        B, N = items.shape
        valid = row_mask(lengths, N)  # [B, N]
        vmask = valid[..., None].to(self.item_embedding.weight.dtype)
        x = self.embed(items, actions) * vmask
        pos = torch.arange(N, device=items.device).expand(B, N)
        no_self = torch.full_like(pos, -1)
        keys, values, shared = [], [], {"self_causal": True}
        for layer in self.layers:
            u, q, k, v = layer.project(x)
            k = k * vmask[..., None]  # padding rows hold zeros in the cache
            v = v * vmask[..., None]
            attn = layer.attend(q, k, v, pos, pos, timestamps, timestamps, lengths, no_self, shared)
            x = layer.output(x, attn, u)
            keys.append(k)
            values.append(v)
        states = self.final_norm(x) * vmask
        return HistoryCache(
            keys=torch.stack(keys),
            values=torch.stack(values),
            states=states,
            timestamps=timestamps * valid,
            lengths=lengths,
        )

    # ---- fused CPU step ----------------------------------------------------------------------
    def _append_fused(self, out: HistoryCache, items, actions, timestamps, rows: Sequence[int]) -> bool:
        """One event per user by the fused CPU kernel (``ops.cpu_kernels``), user b's written into
        row rows[b] of `out`'s buffers, after its rows[b] cached rows. False, with nothing written,
        where it does not apply: no users, training or autograd, code embeddings not folded, tensors
        that are not float32 on the CPU, the backend forced by GENREC_OPS_BACKEND, numba missing."""
        if self.training or torch.is_grad_enabled() or not len(rows) or self.code_embedding is not None:
            return False
        kernels = ops.fused_cpu_kernels(out.keys, out.values, out.states, self.item_embedding.weight)
        weights = self._fused_weights() if kernels is not None else None
        if weights is None or out.keys.stride(-1) != 1 or out.values.stride(-1) != 1:
            return False
        kernels.append_one_event(
            items.numpy(), actions.numpy(), timestamps.numpy(), np.asarray(rows, dtype=np.int64),
            *kernels.flat(out.keys), *kernels.flat(out.values), out.states.numpy(), out.timestamps.numpy(), *weights,
        )
        return True

    def _fused_weights(self):
        """The kernel's weight arguments: numpy views of the parameters (not copies, so they
        follow in-place updates), rebuilt when a parameter tensor is replaced. None when the
        layers differ in what the kernel takes as one constant (LayerNorm eps) or not float32."""
        cached = getattr(self, "_fused_cache", None)
        # the parameter tensors are listed once per registration of any parameter anywhere (a
        # replaced weight registers anew); a moved one is caught by its address
        if cached is not None and cached[0] == _PARAMETER_REGISTRATIONS[0]:
            if tuple(map(torch.Tensor.data_ptr, cached[1])) == cached[2]:
                return cached[3]
        params = tuple(self.parameters())
        layers = self.layers
        norms = [m for m in self.modules() if isinstance(m, nn.LayerNorm)]
        if len({m.eps for m in norms}) != 1 or any(p.dtype != torch.float32 for p in params):
            weights = None
        else:
            a = lambda t: t.detach().numpy()  # noqa: E731
            per_layer = [tuple(a(attrgetter(name)(layer)) for layer in layers) for name in (
                "norm.weight", "norm.bias", "f1.weight", "f1.bias", "attn_norm.weight", "attn_norm.bias",
                "f2.weight", "f2.bias", "pos_bias", "time_bias")]  # the kernel's per-layer tuples, in its order
            f32 = np.float32
            weights = (
                a(self.item_embedding.weight), a(self.action_embedding.weight), f32(self.embed_scale), *per_layer,
                f32(norms[0].eps), a(self.final_norm.weight), a(self.final_norm.bias),
                ops.time_bucket_thresholds(self.cfg.num_time_buckets, self.cfg.time_bucket_base).numpy(),
                f32(layers[0].scale), f32(1.0 / layers[0].attn_divisor),
            )
        self._fused_cache = (_PARAMETER_REGISTRATIONS[0], params, tuple(map(torch.Tensor.data_ptr, params)), weights)
        return weights

    def warm_up(self) -> None:
        """One streaming append on a one-event history: compiles the fused kernel (seconds on first
        use, then cached on disk), so that no user's request pays for it."""
        one = torch.ones(1, 1, dtype=torch.long, device=self.item_embedding.weight.device)
        with torch.inference_mode():
            self.append(self(one, one, one, one[0]).reserve(2), one, one, one, one[0], in_place=True)

    # ---- incremental encode -----------------------------------------------------------------
    def append(
        self,
        cache: HistoryCache,
        items: torch.Tensor,  # [B, Nn] new events, left-aligned
        actions: torch.Tensor,  # [B, Nn]
        timestamps: torch.Tensor,  # [B, Nn]
        new_lengths: torch.Tensor,  # [B] long, may be 0 for some users
        in_place: bool = False,
    ) -> HistoryCache:
        """Encode only the new events: user b's new event i sits at position cache.lengths[b] + i
        and attends causally to the cached rows and the new rows before it. Returns the cache of
        the combined histories (N = longest combined history).

        in_place: write the new rows into the spare rows of the cache's buffers (see
        ``HistoryCache.capacity``; full buffers are first regrown to twice the rows, at most
        max_seq_len) instead of copying every cached row into fresh tensors, so that one event
        costs O(1) memory traffic, not O(N). Taken when every user's cached history fills its N rows
        and every user appends Nn events (always so for one user), else the copying path runs. One
        event per user takes the fused CPU kernel on either path, where it applies.
        The result shares memory with `cache`, whose own rows stay as they were; a second
        in-place append to the same `cache` overwrites the first one's new rows.

        Raises ValueError if a combined history would exceed cfg.max_seq_len: positions past the
        bias table and the fixed divisor are not defined there, so the caller must re-encode
        the most recent max_seq_len events with ``forward`` instead.
        """
        B, Nn = items.shape
        No = cache.num_rows
        old_n, new_n = cache.lengths.tolist(), new_lengths.tolist()  # checked on the host, not by tensor ops
        longest = max(map(sum, zip(old_n, new_n)), default=0)
        _check_length(longest, self.cfg.max_seq_len, "append")
        total = cache.lengths + new_lengths
        in_place = in_place and all(n == No for n in old_n) and all(n == Nn for n in new_n)
        n_out = No + Nn if in_place else longest
        if in_place:
            if cache.capacity() < n_out:
                cache = cache.reserve(min(self.cfg.max_seq_len, 2 * n_out))
            out = cache.grown(n_out)  # rows No.. are written below
            out.lengths = total
            if Nn == 1 and self._append_fused(out, items, actions, timestamps, old_n):
                return out
            out.timestamps[:, No:].copy_(timestamps)
            keys, values, k_ts = out.keys, out.values, out.timestamps
        else:
            if Nn == 1 and all(n == 1 for n in new_n):  # one event each onto histories of any lengths
                out = cache.reserve(n_out).grown(n_out)  # fresh buffers, zero past each history
                if self._append_fused(out, items, actions, timestamps, old_n):
                    out.lengths = total
                    return out
            k_ts = merge_rows(cache.timestamps, timestamps, cache.lengths, new_lengths, n_out)
            # every layer's merged rows go straight into the stacked cache tensors
            keys = cache.keys.new_empty((len(self.layers), B, n_out, *cache.keys.shape[3:]))
            values = cache.values.new_empty((len(self.layers), B, n_out, *cache.values.shape[3:]))
        old_len = cache.lengths
        # in place, every new row is valid: no padding to zero
        nmask = None if in_place else row_mask(new_lengths, Nn)[..., None].to(self.item_embedding.weight.dtype)
        x = self.embed(items, actions)
        if nmask is not None:
            x = x * nmask
        q_pos = old_len[:, None] + torch.arange(Nn, device=items.device)[None, :]  # [B, Nn]
        k_pos = torch.arange(n_out, device=items.device).expand(B, n_out)  # row index = position
        no_self = torch.full_like(q_pos, -1)
        shared = {}
        for li, layer in enumerate(self.layers):
            u, q, k, v = layer.project(x)
            if in_place:
                keys[li, :, No:].copy_(k)
                values[li, :, No:].copy_(v)
                k_all, v_all = keys[li], values[li]  # [B, n_out, H, dqk]
            else:
                k_all = merge_rows(cache.keys[li], k, old_len, new_lengths, n_out, out=keys[li])
                v_all = merge_rows(cache.values[li], v, old_len, new_lengths, n_out, out=values[li])
            attn = layer.attend(q, k_all, v_all, q_pos, k_pos, timestamps, k_ts, total, no_self, shared)
            x = layer.output(x, attn, u)
        new_states = self.final_norm(x)
        if in_place:
            out.states[:, No:].copy_(new_states)
            return out
        states = merge_rows(cache.states, new_states * nmask, old_len, new_lengths, n_out)
        return HistoryCache(keys=keys, values=values, states=states, timestamps=k_ts, lengths=total)
