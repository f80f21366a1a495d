"""Seed 000's attention statistics, from full-attention decoding records.

Per user and step t, a_t[i] is the attention history row i receives: head-averaged and pooled
over beams by their normalized generation probabilities (BeamResult.attention[t]["weights"]).
  * concentration: share of a_t held by the top 10% rows of step t
  * stability: the top 25% rows of the reference step (1) kept at later steps hold what share of
    a_t, against the most recent 25% rows and against re-selecting the top 25% at step t
  * Spearman correlation between the reference step's ranking and each later step's ranking,
    over all rows and over the reference step's top 25% rows
All values are means over users.
"""
from __future__ import annotations

import math

import torch

from backend_src.ops.reference import row_mask


def _count(lengths: torch.Tensor, frac: float) -> torch.Tensor:
    """Rows in the top `frac` of each history: max(1, ceil(frac * L))."""
    return torch.clamp(torch.ceil(lengths.double() * frac).long(), min=1)


def _sorted_desc(a: torch.Tensor, mask: torch.Tensor):
    """Descending sort of the valid entries (invalid ones last)."""
    return torch.sort(a.masked_fill(~mask, float("-inf")), dim=1, descending=True)


def top_share(a: torch.Tensor, lengths: torch.Tensor, frac: float) -> torch.Tensor:
    """[B] share of each user's attention held by its own top `frac` rows."""
    mask = row_mask(lengths, a.shape[1])
    vals, _ = _sorted_desc(a, mask)
    csum = torch.cumsum(vals.clamp_min(0).nan_to_num(neginf=0.0), dim=1)
    m = _count(lengths, frac)
    kept = csum.gather(1, (m - 1)[:, None]).squeeze(1)
    total = csum.gather(1, (lengths - 1).clamp_min(0)[:, None]).squeeze(1)
    return kept / total.clamp_min(1e-30)


def top_set(a: torch.Tensor, lengths: torch.Tensor, frac: float) -> torch.Tensor:
    """bool [B, N]: each user's top `frac` rows by a."""
    mask = row_mask(lengths, a.shape[1])
    _, order = _sorted_desc(a, mask)
    chosen = torch.arange(a.shape[1], device=a.device)[None, :] < _count(lengths, frac)[:, None]
    return torch.zeros_like(mask).scatter(1, order, chosen)


def recent_set(lengths: torch.Tensor, n: int, frac: float) -> torch.Tensor:
    """bool [B, N]: each user's most recent `frac` rows (left-aligned histories end at L-1)."""
    j = torch.arange(n, device=lengths.device)[None, :]
    return (j < lengths[:, None]) & (j >= (lengths - _count(lengths, frac))[:, None])


def share_of(a: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B] share of a held by the rows marked in `rows`."""
    mask = row_mask(lengths, a.shape[1])
    total = (a * mask).sum(1)
    return (a * (rows & mask)).sum(1) / total.clamp_min(1e-30)


def _desc_ranks(a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rank (0 = largest) of each entry among the masked entries of its row."""
    _, order = _sorted_desc(a, mask)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(a.shape[1], device=a.device).expand_as(order))
    return ranks.to(torch.float64)


def masked_spearman(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] Spearman rank correlation of x and y over the masked entries of each row
    (Pearson correlation of the ranks; NaN for rows with fewer than 2 entries)."""
    rx, ry = _desc_ranks(x, mask), _desc_ranks(y, mask)
    m = mask.to(torch.float64)
    n = m.sum(1)
    mx = (rx * m).sum(1) / n.clamp_min(1)
    my = (ry * m).sum(1) / n.clamp_min(1)
    dx, dy = (rx - mx[:, None]) * m, (ry - my[:, None]) * m
    cov = (dx * dy).sum(1)
    den = torch.sqrt((dx * dx).sum(1) * (dy * dy).sum(1))
    rho = cov / den
    return torch.where(n >= 2, rho, torch.full_like(rho, math.nan))


def _mean(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.mean()) if x.numel() else math.nan


def attention_stats(
    records: list, lengths: torch.Tensor, ref_step: int = 1, top_frac: float = 0.10, keep_frac: float = 0.25
) -> dict:
    """records: BeamResult.attention of a full-attention decode (one dict per step with
    'weights' [B, N]); lengths [B]. Returns a flat dict of means over users."""
    weights = [r["weights"].double() for r in sorted(records, key=lambda r: r["step"])]
    lengths = lengths.to(weights[0].device).long()
    n = weights[0].shape[1]
    mask = row_mask(lengths, n)
    out: dict = {"num_users": int(lengths.numel()), "ref_step": ref_step}
    for t, a in enumerate(weights):
        out[f"top{round(top_frac * 100)}_share_step{t}"] = _mean(top_share(a, lengths, top_frac))
    if ref_step >= len(weights):
        return out
    ref = weights[ref_step]
    ref_top = top_set(ref, lengths, keep_frac)
    recent = recent_set(lengths, n, keep_frac)
    pct = round(keep_frac * 100)
    for t in range(ref_step + 1, len(weights)):
        a = weights[t]
        kept = share_of(a, ref_top, lengths)
        resel = top_share(a, lengths, keep_frac)
        rec = share_of(a, recent, lengths)
        out[f"kept_top{pct}_share_step{t}"] = _mean(kept)
        out[f"reselect_top{pct}_share_step{t}"] = _mean(resel)
        out[f"recent{pct}_share_step{t}"] = _mean(rec)
        out[f"kept_minus_reselect_step{t}"] = _mean(kept - resel)
        out[f"kept_minus_recent_step{t}"] = _mean(kept - rec)
        out[f"spearman_step{ref_step}_vs_step{t}"] = _mean(masked_spearman(ref, a, mask))
        out[f"spearman_top{pct}_step{ref_step}_vs_step{t}"] = _mean(masked_spearman(ref, a, ref_top & mask))
    return out


def plot_attention_stats(stats: dict, path_png) -> None:
    """Two panels: top-10% share per step; kept / re-selected / recent 25% shares and Spearman
    correlation per later step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top_keys = sorted(k for k in stats if k.startswith("top") and "_share_step" in k)
    steps = [int(k.rsplit("step", 1)[1]) for k in top_keys]
    ref = stats.get("ref_step", 1)
    later = sorted({int(k.rsplit("step", 1)[1]) for k in stats if k.startswith("kept_top")})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    ax.bar([str(s) for s in steps], [stats[k] for k in top_keys], color="tab:blue")
    ax.set_xlabel("decoding step")
    ax.set_ylabel("attention share")
    ax.set_title(top_keys[0].split("_share")[0].replace("top", "top ") + "% of rows" if top_keys else "")
    ax.set_ylim(0, 1)
    ax = axes[1]
    width = 0.25
    kinds = [("kept_top", f"step-{ref} top rows kept"), ("reselect_top", "re-selected top rows"), ("recent", "most recent rows")]
    for j, (prefix, label) in enumerate(kinds):
        vals = [next((v for k, v in stats.items() if k.startswith(prefix) and k.endswith(f"_share_step{t}")), 0.0) for t in later]
        ax.bar([i + (j - 1) * width for i in range(len(later))], vals, width, label=label)
    sp = [stats.get(f"spearman_step{ref}_vs_step{t}", math.nan) for t in later]
    ax.plot(range(len(later)), sp, "ko--", label=f"Spearman vs step {ref}")
    ax.set_xticks(range(len(later)), [f"step {t}" for t in later])
    ax.set_ylim(min([0.0] + [v - 0.05 for v in sp if v == v]), 1.05)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_title("stability of the step-%d ranking" % ref)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
