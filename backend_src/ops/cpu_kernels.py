"""Fused CPU kernels (numba): work that eager torch does in dozens of small op calls, each paying
dispatch, done in one compiled call. The HSTU encoder's streaming step (one new event per user, all
layers); a beam-search step after the decoder head's layers (``expand_beams``); the co-visitation
lookup (``covisit_scores``). Each has its torch composition as the reference, compared in tests.

Appending one event costs about 10^5 multiply-adds, but in eager torch it is ~130 small op
calls (embedding, per layer LayerNorm, f1, the bias lookups, two attention products, the gate,
f2), each paying dispatch and, after other work has flushed the CPU caches, cache misses on the
interpreter's and dispatcher's own memory: 0.92 ms for one user and 5.3 ms for 16 in the caching
benchmark (perf/results/caching.json), a cost per call rather than per row. This kernel
does the same math as ``HSTUEncoder.append`` (which stays the reference and is compared with
it in tests) in one call, reading the cached K/V in place and writing the new row's K/V, state
and timestamp into the spare row of the cache buffers.

Time buckets use the exact float32 thresholds of the reference's bucket function
(``reference.time_bucket_thresholds``), so they equal the reference's, boundaries included.
"""
from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # the torch path serves (numba is in requirements.txt; a host may lack it)
    numba = None


def available() -> bool:
    return numba is not None


def flat(t):
    """A strided CPU tensor whose last dimension is contiguous -> (1-D numpy array over the
    memory its view spans, its strides in elements), so that the kernel's innermost loops run
    over unit-stride memory that LLVM vectorizes (a strided numba array hides that stride)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.as_strided((span,), (1,), t.storage_offset()).numpy(), t.stride()


# Reassociation lets LLVM vectorize the dot products (the sums' order differs from torch's, as
# any two BLAS do); no assumption about infinities: the bucket thresholds hold inf.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def _njit(fn):
    return numba.njit(cache=True, nogil=True, fastmath=_FASTMATH)(fn) if numba is not None else fn


@_njit
def _layer_norm(x, w, b, eps, out):
    n = x.shape[0]
    mean = np.float32(0.0)
    for i in range(n):
        mean += x[i]
    mean /= n
    var = np.float32(0.0)
    for i in range(n):
        c = x[i] - mean
        var += c * c
    inv = np.float32(1.0) / np.sqrt(var / n + eps)
    for i in range(n):
        out[i] = (x[i] - mean) * inv * w[i] + b[i]


@_njit
def _silu(x):
    return x / (np.float32(1.0) + np.exp(-x))


@_njit
def _linear(w, b, x, out):
    """out = w x + b; w [out, in] (torch's Linear layout)."""
    for o in range(w.shape[0]):
        acc = np.float32(0.0)
        for i in range(w.shape[1]):
            acc += w[o, i] * x[i]
        out[o] = acc + b[o]


@_njit
def _bucket(dt, thr):
    """Number of thresholds thr[1..T-1] <= dt: the reference's time bucket of float32 |dt|."""
    lo, hi = 0, thr.shape[0] - 2  # answer in [0, T-1]; thr[0] = 0, thr[T] = inf
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if thr[mid] <= dt:
            lo = mid
        else:
            hi = mid - 1
    return lo


@_njit
def append_one_event(
    items, actions, timestamps,  # [B, 1] the new event of each user
    rows,  # [B] int64: user b's cached rows; its new row is row rows[b] (position rows[b])
    keys, ks, values, vs,  # the K/V cache [L, B, N, H, d] as a flat buffer and its element strides (see flat())
    states, k_ts,  # [B, N, D], [B, N]; row rows[b] of these and of K/V is written (N > max(rows))
    item_emb, action_emb, embed_scale,
    ln_w, ln_b, f1_w, f1_b, attn_ln_w, attn_ln_b, f2_w, f2_b, pos_bias, time_bias,  # tuples, one entry per layer
    eps, final_w, final_b, thr, scale, inv_norm,
):
    """x = (E_item + E_action) * sqrt(D); per layer U, V, Q, K = split(silu(f1(LN(x)))),
    A = silu(scale q.k_j + rab_pos(n - j) + rab_time(bucket|t - t_j|)) / N over rows j <= n,
    x = x + f2(LN(A V) * U); state = LN_final(x)."""
    B = items.shape[0]
    L = len(f1_w)
    H = pos_bias[0].shape[0]
    D = item_emb.shape[1]
    dqk = (f1_w[0].shape[0] - 2 * D) // (2 * H)  # f1: D -> U, V (H dv each, H dv = D), Q, K (H dqk each)
    dv = D // H
    P = pos_bias[0].shape[1]
    x = np.empty(D, np.float32)
    h = np.empty(D, np.float32)
    proj = np.empty(f1_w[0].shape[0], np.float32)
    attn = np.empty(H * dv, np.float32)
    gated = np.empty(H * dv, np.float32)
    y = np.empty(D, np.float32)
    tb = np.empty(rows.max() + 1, np.int64)
    for b in range(B):
        n = rows[b]
        t = timestamps[b, 0]
        k_ts[b, n] = t
        for j in range(n + 1):
            tb[j] = _bucket(np.float32(abs(t - k_ts[b, j])), thr)
        for i in range(D):
            x[i] = (item_emb[items[b, 0], i] + action_emb[actions[b, 0], i]) * embed_scale
        for li in range(L):
            _layer_norm(x, ln_w[li], ln_b[li], eps, h)
            _linear(f1_w[li], f1_b[li], h, proj)
            for i in range(proj.shape[0]):
                proj[i] = _silu(proj[i])
            # proj = [U | V | Q | K], heads contiguous inside each part
            ov, oq, ok = H * dv, 2 * H * dv, 2 * H * dv + H * dqk
            k0, v0 = li * ks[0] + b * ks[1], li * vs[0] + b * vs[1]  # this (layer, user)'s rows
            for hh in range(H):
                for c in range(dqk):
                    keys[k0 + n * ks[2] + hh * ks[3] + c] = proj[ok + hh * dqk + c]
                for c in range(dv):
                    values[v0 + n * vs[2] + hh * vs[3] + c] = proj[ov + hh * dv + c]
            for hh in range(H):
                for c in range(dv):
                    attn[hh * dv + c] = 0.0
                for j in range(n + 1):
                    kr, vr = k0 + j * ks[2] + hh * ks[3], v0 + j * vs[2] + hh * vs[3]
                    s = np.float32(0.0)
                    for c in range(dqk):  # unit stride: vectorized
                        s += proj[oq + hh * dqk + c] * keys[kr + c]
                    s = s * scale + pos_bias[li][hh, min(n - j, P - 1)] + time_bias[li][hh, tb[j]]
                    a = _silu(s)
                    for c in range(dv):
                        attn[hh * dv + c] += a * values[vr + c]
            for i in range(H * dv):
                attn[i] *= inv_norm
            _layer_norm(attn, attn_ln_w[li], attn_ln_b[li], eps, gated)
            for i in range(H * dv):
                gated[i] *= proj[i]  # * U
            _linear(f2_w[li], f2_b[li], gated, y)
            for i in range(D):
                x[i] += y[i]
        _layer_norm(x, final_w, final_b, eps, h)
        for i in range(D):
            states[b, n, i] = h[i]


@_njit
def expand_beams(h, out_w, out_b, kids, cont_bias, child, node_emb, beam_lp, prefix, codes, prefix_emb, code_emb,
                 out_lp, out_parent, out_prefix, out_codes, out_emb):
    """One beam-search step after the decoder's head (decoding.beam_search.expand_beams, whose torch
    composition is the reference), per user: each live beam's continuations c scored
    logit = w_c . h + b_c (+ e_{p.c} . h with node output), log_softmax over the beam's
    continuations + the beam's score; the best K = out_lp.shape[1] of the Wt M (sorted, best first;
    equal scores in continuation order); and the beams they make: parent, level-(t+1) prefix
    child[p, c], codes so far + c, prefix embedding + the code's; -1 codes and prefixes for a dead
    (-inf) beam, whose embedding gains nothing.
    h [B, Wt, D]; out_w [C, D], out_b [C]; kids [P + 1, M] each prefix's continuations (or
    [0, 0]: all C codes, M = C) with cont_bias [P + 1, M] 0 / -inf; child [P, C]; node_emb
    [N + 1, D] (or [0, D]: no node output); beam_lp, prefix [B, Wt]; codes [B, Wt, t];
    prefix_emb [B, Wt, D] and code_emb [C, D] (or [0, 0, 0] and [0, 0] at the last step)."""
    B, Wt, D = h.shape
    own_codes = kids.shape[0] == 0
    M = cont_bias.shape[1]
    N, K, T = Wt * M, out_lp.shape[1], codes.shape[2]
    has_nodes, has_emb = node_emb.shape[0] > 0, out_emb.shape[0] > 0
    scores = np.empty(N, np.float32)
    for b in range(B):
        for w in range(Wt):
            row, p = w * M, prefix[b, w]
            if beam_lp[b, w] == -np.inf or p < 0:  # a dead beam stays dead
                for m in range(M):
                    scores[row + m] = -np.inf
                continue
            top = -np.inf
            for m in range(M):
                v = -np.inf
                if cont_bias[p, m] != -np.inf:
                    c = m if own_codes else kids[p, m]
                    v = out_b[c]
                    for d in range(D):
                        v += out_w[c, d] * h[b, w, d]
                    if has_nodes:
                        n = child[p, c]
                        if n >= 0:
                            for d in range(D):
                                v += node_emb[n, d] * h[b, w, d]
                    v += cont_bias[p, m]
                scores[row + m] = v
                top = max(top, v)
            if top == -np.inf or top != top:  # no continuation (or a NaN logit): the beam ends here
                for m in range(M):
                    scores[row + m] = -np.inf
                continue
            total = np.float32(0.0)
            for m in range(M):
                total += np.exp(scores[row + m] - top)
            log_total = np.log(total)
            for m in range(M):
                scores[row + m] = (scores[row + m] - top) - log_total + beam_lp[b, w]
        if K < N:  # the K-th best score, then every score above it and, in order, enough equal to it
            threshold = np.partition(scores, N - K)[N - K]
            chosen = np.empty(K, np.int64)
            k = 0
            for i in range(N):
                if scores[i] > threshold:
                    chosen[k] = i
                    k += 1
            for i in range(N):
                if k == K:
                    break
                if scores[i] == threshold:
                    chosen[k] = i
                    k += 1
        else:
            chosen = np.arange(N)
        order = np.argsort(-scores[chosen], kind="mergesort")  # stable: ties stay in continuation order
        for k in range(K):
            i = chosen[order[k]]
            w, m = i // M, i % M
            lp = scores[i]
            live = lp != -np.inf
            p = prefix[b, w]
            c = (m if own_codes else kids[p, m]) if live else -1
            out_lp[b, k] = lp
            out_parent[b, k] = w
            out_prefix[b, k] = child[p, c] if live else -1
            for j in range(T):
                out_codes[b, k, j] = codes[b, w, j]
            out_codes[b, k, T] = c
            if has_emb:
                for d in range(D):
                    out_emb[b, k, d] = prefix_emb[b, w, d] + (code_emb[c, d] if live else np.float32(0.0))


@_njit
def covisit_scores(history, candidates, pair_keys, pair_weights, num_items, window, decay, out):
    """The co-visitation expert's score (model/covisitation.py, whose torch composition is the
    reference): out[b, w] = log(1 + sum_g decay^(g-1) C[h_(n+1-g), c]) over the last `window` of
    the n events of history[b] (events first, 0 after), c = candidates[b, w]; C read from the
    sorted pair keys a * (num_items + 1) + c by binary search; an item past num_items (the unknown
    item, a catalog addition) has no counts."""
    B, W = candidates.shape
    P = pair_keys.shape[0]
    for b in range(B):
        n = 0
        for j in range(history.shape[1]):
            n += history[b, j] > 0
        for w in range(W):
            c = candidates[b, w]
            total = np.float32(0.0)
            weight = np.float32(1.0)
            for g in range(1, window + 1):
                if n - g >= 0 and 0 < history[b, n - g] <= num_items and 0 < c <= num_items:
                    key = history[b, n - g] * (num_items + 1) + c
                    i = np.searchsorted(pair_keys, key)
                    if i < P and pair_keys[i] == key:
                        total += pair_weights[i] * weight
                weight *= np.float32(decay)
            out[b, w] = np.log1p(total)
