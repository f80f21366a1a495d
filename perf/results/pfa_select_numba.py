"""Tried and not kept: PFA's selection step and the full-attention step as fused numba kernels.

The selection's softmax and beam pooling fused into one pass per (user, beam, head) row, with a
vectorizable exp (Cephes polynomial, the power of two built from the exponent bits) instead of
torch's softmax and pooling matmul; the step's output from the selection's own weights gathered at
the kept rows (a numba gather, then one batched matmul) instead of attention over the gathered K/V.
For fairness the same softmax also replaces SDPA in a full-attention step (logits matmul, numba
softmax, weights-times-V matmul). Logits stay torch batched matmuls. Checked against the torch
reference first; then the step on its own and whole decodes (perf.bench_decode's setting: beam
100, d 64, 2 heads, k 256, r 0.5, s 1), every variant side by side per round, medians. Run alone,
with the glibc settings of `make bench-offline` and OpenMP's default wait policy:

    python perf/results/pfa_select_numba.py > perf/results/pfa_select_numba.txt

Written against the ops of commit 81b0781, where ops.pfa_select also returned the selection
step's output: run it at that commit.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import backend_src.decoding.beam_search as beam_search  # noqa: E402
from backend_src.config import DecodeOptions  # noqa: E402
from backend_src.ops import reference as R  # noqa: E402
from perf.bench_decode import VARIANTS, build  # noqa: E402

FM = {"reassoc", "contract", "nsz", "arcp"}
LOG2E, C1, C2 = np.float32(1.4426950408889634), np.float32(0.693359375), np.float32(-2.12194440e-4)
LANES = 16  # the row max in 16 partial maxima, which LLVM vectorizes (a plain max loop it does not)


@njit(fastmath=FM, inline="always")
def _row_max(row, n, acc):
    acc[:] = row[0]
    n16 = n - n % LANES
    for j0 in range(0, n16, LANES):
        for i in range(LANES):
            acc[i] = max(acc[i], row[j0 + i])
    m = acc.max()
    for j in range(n16, n):
        m = max(m, row[j])
    return m


@njit(fastmath=FM, inline="always")
def _exp_shifted(row, n, m, ibuf, fbuf):
    """row[:n] <- exp(row[:n] - m) (m >= every row[j]); returns their sum. fbuf views ibuf."""
    for j in range(n):
        x = max(row[j] - m, np.float32(-87.0))
        k = np.floor(x * LOG2E + np.float32(0.5))
        r = x - k * C1 - k * C2
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        row[j] = p * r * r + r + np.float32(1.0)
        ibuf[j] = (np.int32(k) + np.int32(127)) << np.int32(23)  # the bits of 2^k
    s = np.float32(0.0)
    for j in range(n):
        row[j] *= fbuf[j]
        s += row[j]
    return s


@njit(parallel=True, fastmath=FM)
def softmax_pool(logits, lengths, pool, scores):
    """logits [H, B, W, N] -> exp(l - row max) in place; scores[b] = sum_h,w pool[b,w]/H * softmax."""
    H, B, W, N = logits.shape
    for b in prange(B):
        n = lengths[b]
        ibuf = np.empty(N, np.int32)
        fbuf, acc = ibuf.view(np.float32), np.empty(LANES, np.float32)
        scores[b, :] = 0
        for h in range(H):
            for w in range(W):
                row = logits[h, b, w]
                s = _exp_shifted(row, n, _row_max(row, n, acc), ibuf, fbuf)
                c = pool[b, w] / (s * H)
                for j in range(n):
                    scores[b, j] += c * row[j]
        scores[b, n:] = -np.inf


@njit(parallel=True, fastmath=FM)
def softmax_rows(logits, lengths):
    """logits [H, B, W, N] -> softmax over each row's first lengths[b] entries, 0 after, in place."""
    H, B, W, N = logits.shape
    for bw in prange(B * W):
        b, w = bw // W, bw % W
        n = lengths[b]
        ibuf = np.empty(N, np.int32)
        fbuf, acc = ibuf.view(np.float32), np.empty(LANES, np.float32)
        for h in range(H):
            row = logits[h, b, w]
            inv = np.float32(1.0) / _exp_shifted(row, n, _row_max(row, n, acc), ibuf, fbuf)
            row[:n] *= inv
            row[n:] = 0


@njit(parallel=True, fastmath=FM)
def gather_kept(weights, order, counts, out):
    """out[b, h, w, j] = weights[h, b, w, order[b, j]] renormalized over j < counts[b] (0 after)."""
    H, B, W, _ = weights.shape
    for bw in prange(B * W):
        b, w = bw // W, bw % W
        kn = counts[b]
        for h in range(H):
            o = out[b, h, w]
            s = np.float32(0.0)
            for j in range(kn):
                o[j] = weights[h, b, w, order[b, j]]
                s += o[j]
            o[:kn] /= s
            o[kn:] = 0


def _logits(q, k):  # [B, W, H, d] x [B, N, H, d] -> [H, B, W, N], one batched matmul per head
    B, W, H, d = q.shape
    out = torch.empty(H, B, W, k.shape[1])
    qs = q * d**-0.5
    for h in range(H):
        torch.bmm(qs[:, :, h], k[:, :, h].transpose(1, 2), out=out[h])
    return out


def pfa_select_numba(q, k, v, lengths, beam_weights, keep):
    B, W, H, _ = q.shape
    N = k.shape[1]
    weights, scores = _logits(q, k), torch.empty(B, N)
    softmax_pool(weights.numpy(), lengths.numpy(), beam_weights.float().contiguous().numpy(), scores.numpy())
    keep = min(keep, N)
    order = torch.topk(scores, keep, dim=1).indices
    kept_lengths = lengths.clamp(max=keep)
    kept = torch.empty(B, H, W, keep)
    gather_kept(weights.numpy(), order.numpy(), kept_lengths.numpy(), kept.numpy())
    out = torch.matmul(kept, R.gather_rows(v, order).transpose(1, 2))  # [B, H, W, d]
    return out.transpose(1, 2), order, kept_lengths


def decode_attention_numba(q, k, v, lengths):
    weights = _logits(q, k)
    softmax_rows(weights.numpy(), lengths.numpy())
    return torch.stack([torch.bmm(weights[h], v[:, :, h]) for h in range(q.shape[2])], 2)


def medians(calls, rounds):
    times = {name: [] for name in calls}
    for _ in range(rounds + 1):  # the first round is warm-up
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}


@torch.no_grad()
def main():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    q, kv = torch.randn(3, 7, 2, 32), torch.randn(3, 40, 2, 2, 32)
    lengths, pool = torch.tensor([40, 23, 31]), torch.softmax(torch.randn(3, 7), 1)
    ref, fast = R.pfa_select(q, kv[:, :, 0], kv[:, :, 1], lengths, pool, 16), \
        pfa_select_numba(q, kv[:, :, 0], kv[:, :, 1], lengths, pool, 16)
    full_err = (R.decode_attention(q, kv[:, :, 0], kv[:, :, 1], lengths)
                - decode_attention_numba(q, kv[:, :, 0], kv[:, :, 1], lengths)).abs().max()
    print(f"torch {torch.__version__}, 2 threads; check vs the torch reference: selection output "
          f"max |diff| {(ref[0] - fast[0]).abs().max():.1e}, same order {bool((ref[1] == fast[1]).all())}; "
          f"full step {full_err:.1e}")
    codebook, decoders = build(16384, 64, 2, 2048, 0)
    for n, users in ((512, 32), (2048, 8)):
        gen = torch.Generator().manual_seed(n)
        states, lengths = torch.randn(users, n, 64, generator=gen), torch.full((users,), n)
        q = torch.randn(users, 100, 2, 32, generator=gen)
        k, v = decoders[False].project_step(states, 1)
        pool = torch.softmax(torch.randn(users, 100, generator=gen), 1)
        step = medians({
            "selection, torch": lambda: R.pfa_select(q, k, v, lengths, pool, 256),
            "selection, numba": lambda: pfa_select_numba(q, k, v, lengths, pool, 256),
            "full step, SDPA": lambda: R.decode_attention(q, k, v, lengths),
            "full step, numba softmax": lambda: decode_attention_numba(q, k, v, lengths),
        }, 21)

        def decode(mode, numba_ops):
            opts = DecodeOptions(beam_width=100, **VARIANTS[mode][0])

            def run():  # the decoder calls its ops through the ops module: swap them for this call
                beam_search.ops.pfa_select = pfa_select_numba if numba_ops else R.pfa_select
                beam_search.ops.decode_attention = decode_attention_numba if numba_ops else R.decode_attention
                return beam_search.generate(decoders[False], codebook, states, lengths, opts)
            return run

        whole = medians({f"{m}, {'numba' if nb else 'torch'}": decode(m, nb)
                         for m in ("full", "pfa") for nb in (False, True)}, 9)
        print(f"\nhistory {n}, {users} users (ms, medians of 21 steps / 9 decodes)")
        for name, ms in {**step, **{f"whole decode, {k}": v for k, v in whole.items()}}.items():
            print(f"  {name:36s} {ms:7.2f}")
        best_full = min(whole["full, torch"], whole["full, numba"])
        print(f"  PFA vs full: torch {whole['full, torch'] / whole['pfa, torch']:.2f}x, numba selection vs the "
              f"faster full {best_full / whole['pfa, numba']:.2f}x")
    beam_search.ops.pfa_select, beam_search.ops.decode_attention = R.pfa_select, R.decode_attention


if __name__ == "__main__":
    main()
