"""Training of the generative recommender: one HSTU backbone, two heads trained together.

loss = sum_t CE(decoder logits at level t, next item's code t)      (generative retrieval; over all
                                                                     codes or the prefix's valid ones)
     + ranker_weight * CE(M-FALCON score of next item vs negatives)  (target-aware ranking)
     + dense_weight  * CE(state @ item embeddings, next item)        (auxiliary: shapes the backbone)
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from backend_src.config import ModelConfig, TrainConfig
from backend_src.data.sequences import length_bucketed, train_batches
from backend_src.model.recommender import GenerativeRecommender
from backend_src.model.semantic_ids import SemanticIdCodebook


class NegativeSampler:
    """Ranking negatives: hard ones that share the positive's first semantic-ID code (the beam
    search hands the ranker exactly such near misses), a `hard_fraction` of them, and the rest
    uniform over the catalog."""

    def __init__(self, codes: torch.Tensor, num_items: int, hard_fraction: float = 0.5):
        if not 0.0 <= hard_fraction <= 1.0:
            raise ValueError(f"hard_fraction must be in [0, 1], got {hard_fraction}")
        self.hard_fraction = hard_fraction
        first = codes[1:, 0]  # [I] level-0 code of items 1..I
        order = torch.argsort(first, stable=True)
        self.items_by_code = order + 1  # item indices grouped by first code
        counts = torch.bincount(first, minlength=int(first.max()) + 1)
        self.group_start = torch.cumsum(counts, 0) - counts
        self.group_size = counts
        self.first = codes[:, 0].clamp_min(0)
        self.num_items = num_items

    def sample(self, positives: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        B = positives.shape[0]
        n_hard = int(n * self.hard_fraction)
        uniform = torch.randint(1, self.num_items + 1, (B, n - n_hard), generator=generator)
        code = self.first[positives]  # [B]
        offs = (torch.rand(B, n_hard, generator=generator) * self.group_size[code][:, None]).long()
        hard = self.items_by_code[self.group_start[code][:, None] + offs]
        return torch.cat([hard, uniform], dim=1)


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    seconds: float = 0.0
    best_metric: float = -1.0


def build_model(data, cfg: ModelConfig, embedding_dim: int = 64, seed: int = 0, end_offset: int = 2) -> GenerativeRecommender:
    """A fresh model whose semantic IDs are fit on each user's events but the last end_offset."""
    codebook = SemanticIdCodebook.build(data, cfg, dim=embedding_dim, seed=seed, end_offset=end_offset)
    cfg.codebook_sizes = tuple(int(c) for c in codebook.codebook_sizes)
    torch.manual_seed(seed)
    return GenerativeRecommender(cfg, codebook, data.item_ids)


def losses(model: GenerativeRecommender, batch, sampler: NegativeSampler, tcfg: TrainConfig, gen: torch.Generator):
    cache = model.backbone(batch.items, batch.actions, batch.timestamps, batch.lengths)
    targets = batch.targets  # [B, N] next item per position, 0 = none
    valid = targets > 0
    codes = model.codebook.codes[targets]  # [B, N, 4]
    logits = model.decoder.training_logits(cache.states, batch.lengths, codes)
    out = {"retrieval": code_loss(model.codebook, [lt[valid] for lt in logits], codes[valid], tcfg.code_loss)}

    if tcfg.ranker_weight > 0:
        # one random position per user: its next item against sampled negatives
        n_valid = valid.sum(1)
        pos = (torch.rand(len(n_valid), generator=gen) * n_valid).long()
        positives = targets.gather(1, pos[:, None]).squeeze(1)
        negatives = sampler.sample(positives, model.cfg.ranker_negatives, gen)
        out["ranking"] = tcfg.ranker_weight * model.ranker.training_loss(cache, pos, positives, negatives)

    dense_weight = tcfg.extra.get("dense_weight", 1.0)
    if dense_weight > 0:
        n_neg = tcfg.extra.get("dense_negatives", 0)
        negatives = torch.randint(1, model.cfg.num_items + 1, (n_neg,), generator=gen) if n_neg > 0 else None
        out["dense"] = dense_weight * dense_loss(model, cache.states[valid], targets[valid], negatives)
    return out


def code_loss(codebook: SemanticIdCodebook, logits: list, codes: torch.Tensor, over: str = "all") -> torch.Tensor:
    """Sum over levels t of the cross-entropy of the target's code t (logits [P, C_t] per level,
    codes [P, 4]), normalized over all C_t codes ("all") or only over the codes that continue the
    target's level-t prefix to some item ("valid"): the softmax constrained beam search takes,
    so training spends nothing on codes decoding never scores and the level-t loss becomes
    -log p(code_t | prefix) among its siblings (0 where the prefix has one child)."""
    if over not in ("all", "valid"):
        raise ValueError(f"code loss must be over 'all' or 'valid' codes, got {over!r}")
    prefixes = codebook.level_prefixes(codes) if over == "valid" else None  # [P, 5]
    total = 0.0
    for t, lt in enumerate(logits):
        if prefixes is not None:
            lt = lt + codebook.code_bias(prefixes[:, t], t)  # -inf on codes off the prefix
        total = total + F.cross_entropy(lt, codes[:, t])
    return total


def dense_loss(model: GenerativeRecommender, states, targets, negatives: torch.Tensor | None = None):
    """CE of the next item by the dense head (states [P, D], targets [P]): over the whole catalog,
    or over the target and `negatives` [S] shared by the batch (a sampled softmax; a negative
    equal to the target is masked), which costs S / num_items of the full product."""
    if negatives is None:
        return F.cross_entropy(model.dense_scores(states), targets)
    states, emb = model.dense_operands(states)
    pos = (states * emb[targets]).sum(-1, keepdim=True)  # [P, 1]
    neg = (states @ emb[negatives].T).masked_fill(negatives[None, :] == targets[:, None], float("-inf"))  # [P, S]
    return F.cross_entropy(torch.cat([pos, neg], 1), torch.zeros_like(targets))


def lr_scale(tcfg: TrainConfig, progress: float) -> float:
    """Learning-rate multiplier at `progress` in [0, 1] of the run."""
    if tcfg.lr_schedule == "constant":
        return 1.0
    if tcfg.lr_schedule != "cosine":
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {tcfg.lr_schedule!r}")
    lo = tcfg.lr_min_ratio
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def train(
    model: GenerativeRecommender,
    data,
    tcfg: TrainConfig,
    minutes: float | None = None,
    evaluate_fn=None,  # callable(model) -> float (higher is better), run after each epoch
    checkpoint_path=None,
    log=print,
) -> TrainState:
    gen = torch.Generator().manual_seed(tcfg.seed)
    rng = np.random.default_rng(tcfg.seed)
    sampler = NegativeSampler(model.codebook.codes, model.cfg.num_items, model.cfg.ranker_hard_fraction)
    opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.98))
    state = TrainState()
    start = time.time()
    deadline = start + 60 * minutes if minutes else math.inf
    for epoch in range(tcfg.epochs):
        model.train()
        state.epoch = epoch
        sums: dict = {}
        n = 0
        # large shuffled batches re-split by length: short histories don't pay for long ones' padding
        chunk = train_batches(
            data, tcfg.batch_size * 16, model.cfg.max_seq_len, rng,
            stochastic_length_alpha=tcfg.stochastic_length_alpha, end_offset=tcfg.end_offset,
        )
        bar = tqdm(
            length_bucketed(chunk, tcfg.batch_size, rng),
            desc=f"epoch {epoch}",
            leave=False,
            mininterval=2.0,
        )
        for batch in bar:
            # progress: the larger of the time and epoch fractions (whichever ends the run first)
            progress = max((time.time() - start) / (60 * minutes) if minutes else 0.0, epoch / tcfg.epochs)
            for group in opt.param_groups:
                group["lr"] = tcfg.lr * lr_scale(tcfg, progress)
            parts = losses(model, batch, sampler, tcfg, gen)
            loss = sum(parts.values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state.step += 1
            n += 1
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
            if state.step % 20 == 0:
                bar.set_postfix({k: f"{v / n:.3f}" for k, v in sums.items()})
            if time.time() > deadline:
                break
        state.seconds = time.time() - start
        msg = " ".join(f"{k}={v / max(n, 1):.4f}" for k, v in sums.items())
        metric = None
        if evaluate_fn is not None:
            model.eval()
            metric = evaluate_fn(model)
            if metric > state.best_metric:
                state.best_metric = metric
                if checkpoint_path:
                    model.save(checkpoint_path, {"epoch": epoch, "valid_metric": metric, "train_seconds": state.seconds})
        elif checkpoint_path:
            model.save(checkpoint_path, {"epoch": epoch, "train_seconds": state.seconds})
        log(f"epoch {epoch} [{state.seconds / 60:.1f} min] {msg}" + (f" valid={metric:.4f}" if metric is not None else ""))
        if time.time() > deadline:
            log(f"time budget of {minutes} min reached")
            break
    return state
