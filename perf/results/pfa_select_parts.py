"""Where PFA's selection step spends its time on this CPU, beside one full-attention step.

The selection (ops.pfa_select, torch reference) per head: the logits of every beam over every row
(a batched matmul), their softmax, the probability-weighted pooling; then one top-k, the gather of
the kept K/V rows and attention over them. A full-attention step is one fused SDPA call. Also timed:
the step's output from the selection's own probabilities (gathered at the kept rows and
renormalized) instead of attention over the gathered rows. Beam 100, 2 heads of 32; medians of 21
rounds, all variants side by side per round. Run alone on the machine, with OpenMP's default wait
policy (as `make bench-offline`):

    python perf/results/pfa_select_parts.py > perf/results/pfa_select_parts.txt
"""
import time

import torch

from backend_src.ops import reference as R

W, H, D, KEEP = 100, 2, 32, 256


def select_reusing_probs(q, k, v, lengths, beam_weights, keep):
    """pfa_select with the step output taken from the selection's softmax at the kept rows."""
    B, _, _, d = q.shape
    N = k.shape[1]
    valid = R._row_mask(lengths, N)  # every history is full here: no mask pass, as in pfa_select
    qs = q * d**-0.5
    probs = [torch.softmax(torch.bmm(qs[:, :, h], k[:, :, h].transpose(1, 2)), -1) for h in range(H)]
    scores = sum(torch.bmm((beam_weights / H)[:, None, :], a).squeeze(1) for a in probs)
    order = torch.topk(scores.masked_fill(~valid, float("-inf")), keep, dim=1).indices
    vk = R.gather_rows(v, order)
    idx = order[:, None, :].expand(B, W, keep)
    kept = [a.gather(2, idx) for a in probs]
    out = torch.stack([torch.bmm(a / a.sum(-1, keepdim=True), vk[:, :, h]) for h, a in enumerate(kept)], 2)
    return out, order


def main():
    print(f"torch {torch.__version__}, beam {W}, {H} heads x {D}, keep {KEEP}; ms, median of 21")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for B, N in ((32, 512), (8, 2048)):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, n, H, D, generator=g) for n in (W, N, N))
            lengths = torch.full((B,), N)
            bw = torch.softmax(torch.randn(B, W, generator=g), 1)
            qs = q * D**-0.5
            e = torch.bmm(qs[:, :, 0], k[:, :, 0].transpose(1, 2))
            order = torch.topk(torch.randn(B, N, generator=g), KEEP, 1).indices
            kg, vg = R.gather_rows(k, order), R.gather_rows(v, order)
            calls = {
                "full-attention step (SDPA over N)": lambda: R.decode_attention(q, k, v, lengths),
                "pfa_select (whole)": lambda: R.pfa_select(q, k, v, lengths, bw, KEEP),
                "  logits, one head (bmm)": lambda: torch.bmm(qs[:, :, 0], k[:, :, 0].transpose(1, 2)),
                "  softmax, one head": lambda: torch.softmax(e, -1),
                "  pooling, one head (bmm)": lambda: torch.bmm(bw[:, None, :], e),
                "  top-k": lambda: torch.topk(e[:, 0], KEEP, 1, sorted=True),
                "  gather kept K and V": lambda: (R.gather_rows(k, order), R.gather_rows(v, order)),
                "  attention over the kept rows": lambda: R.decode_attention(q, kg, vg, lengths.clamp(max=KEEP)),
                "pfa_select reusing the probabilities": lambda: select_reusing_probs(q, k, v, lengths, bw, KEEP),
            }
            ref, alt = calls["pfa_select (whole)"](), calls["pfa_select reusing the probabilities"]()
            assert torch.equal(ref[1], alt[1]) and torch.allclose(ref[0], alt[0], atol=1e-5)
            times = {name: [] for name in calls}
            for _ in range(21):
                for name, fn in calls.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            print(f"\n{threads} thread(s), {B} users x history {N}")
            for name, ts in times.items():
                print(f"  {name:40s} {sorted(ts)[10] * 1e3:7.2f}")


if __name__ == "__main__":
    main()
