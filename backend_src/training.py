"""Training of the generative recommender: one HSTU backbone, two heads trained together.

loss = sum_t CE(decoder logits at level t, next item's code t)      (generative retrieval; over all
                                                                     codes or the prefix's valid ones)
     + ranker_weight * CE(M-FALCON score of next item vs negatives)  (target-aware ranking)
     + dense_weight  * CE(state @ item embeddings, next item)        (auxiliary: shapes the backbone)

Data parallel (under torchrun, once ``backend_src.distributed.init`` has joined the group): every
rank builds the same shuffled global batches from the same seeds and trains on its strided share
of each (``distributed.shard_rows``); the random draws of a step (ranker positions and negatives,
dense negatives) are made for the whole global batch and sliced, and every mean over the batch is
taken over the global count, so the ranks' gradients sum to the single process's gradient on the
global batch. Rank 0 alone evaluates, decides the time budget and writes files.
"""
from __future__ import annotations

import hashlib
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from backend_src import distributed as dist
from backend_src.config import ModelConfig, TrainConfig
from backend_src.data.sequences import Batch, length_bucketed, train_batches, training_events
from backend_src.model.recommender import GenerativeRecommender
from backend_src.model.semantic_ids import SemanticIdCodebook, embedding_sources


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
    epoch: int = 0  # the last epoch run (resuming starts at epoch + 1)
    seconds: float = 0.0  # training time so far, over every resumed run
    best_metric: float = -1.0
    # one entry per epoch: {"epoch", "steps", "train_seconds" (the epoch's steps, no validation),
    # "grad_norm" (mean over the steps, before clipping), the mean loss terms, and "valid" (the
    # validation metric) where the epoch was validated}
    history: list = field(default_factory=list)


def build_model(data, cfg: ModelConfig, embedding_dim: int = 64, seed: int = 0, end_offset: int = 2,
                item_embeddings: str = "auto", balanced_codes: bool = False, quantizer: str = "kmeans",
                node_output: bool = False, log=None) -> GenerativeRecommender:
    """A fresh model whose semantic IDs are fit on each user's events but the last end_offset,
    from the item embeddings of `item_embeddings` (semantic_ids.build_item_embeddings' sources).
    node_output: decoding steps 1..L-1 add a learned vector per prefix they make (the decoder's
    node output; step 0's prefixes are its codes, which the head already has a vector for).
    With cfg.covisit_window, the co-visitation expert counts the same training events.

    Data parallel: rank 0 builds the semantic IDs and broadcasts them, so every rank trains on the
    same codes whatever the numerics of each process (the weights are then seeded alike)."""
    codebook = None
    if dist.is_main():
        codebook = SemanticIdCodebook.build(data, cfg, dim=embedding_dim, seed=seed, end_offset=end_offset,
                                            sources=item_embeddings, balanced=balanced_codes, quantizer=quantizer,
                                            log=log)
    if dist.is_distributed():
        codes, centers, content = dist.broadcast_object(
            (codebook.codes, [codebook.get_buffer(f"center_{t}") for t in range(codebook.num_levels - 1)], codebook.content)
            if codebook is not None else None)
        kept = all(c.numel() for c in centers)
        codebook = SemanticIdCodebook(codes[1:], centers=centers if kept else None, content=content[1:] if kept else None)
    cfg.codebook_sizes = tuple(int(c) for c in codebook.codebook_sizes)
    sources = embedding_sources(data, item_embeddings)
    if getattr(data, "item_attributes", None):
        sources += "+attributes"
    cfg.semantic_id_source = sources if quantizer == "kmeans" else quantizer
    cfg.node_output_sizes = (0,) + codebook.prefix_counts()[1:] if node_output else ()
    torch.manual_seed(seed)
    model = GenerativeRecommender(cfg, codebook, data.item_ids)
    if model.covisitation is not None:
        model.covisitation.fit(*training_events(data, end_offset))
    return model


def loss_names(tcfg: TrainConfig) -> list[str]:
    """The terms `losses` returns under `tcfg`, in order."""
    names = ["retrieval"]
    if tcfg.ranker_weight > 0:
        names.append("ranking")
    if tcfg.dense_weight > 0:
        names.append("dense")
    return names


def take_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """Rows `rows` of a training batch, cut to their longest history."""
    width = max(int(batch.lengths[rows].max()), 1) if len(rows) else 1
    return Batch(batch.items[rows, :width], batch.actions[rows, :width], batch.timestamps[rows, :width],
                 batch.lengths[rows], batch.targets[rows, :width], None, batch.users[rows.numpy()])


def losses(model: GenerativeRecommender, batch, sampler: NegativeSampler, tcfg: TrainConfig, gen: torch.Generator,
           rows: torch.Tensor | None = None) -> dict:
    """The loss terms of a training batch, {name: scalar tensor}.

    rows: the rows of `batch` (the global batch) this process trains on, or None for all of it.
    The random draws are made for the whole batch in the same order whatever `rows` is (so every
    rank's generator stays in step), then sliced; each term is this share's sum divided by the
    whole batch's count, so the shares' terms (and their gradients) sum to the whole batch's.
    An empty share gives zeros that need no backward pass."""
    targets = batch.targets  # [B, N] next item per position, 0 = none
    valid = targets > 0
    dense_weight = tcfg.dense_weight
    if tcfg.ranker_weight > 0:
        # random positions per user (ranker_positions of them, [B, P]): each one's next item against
        # sampled negatives
        n_valid = valid.sum(1)
        pos = (torch.rand(len(n_valid), tcfg.ranker_positions, generator=gen) * n_valid[:, None]).long()
        positives = targets.gather(1, pos)
        negatives = sampler.sample(positives.reshape(-1), model.cfg.ranker_negatives, gen).view(*pos.shape, -1)
        if tcfg.seen_negatives > 0:  # the last of them replaced by events at or before the position
            h = min(tcfg.seen_negatives, negatives.shape[-1])
            negatives[..., -h:] = seen_events(batch.items, pos, h, gen)
    hidden = None
    if tcfg.unknown_item_share > 0:  # events shown as the unknown item
        hidden = (torch.rand(batch.items.shape, generator=gen) < tcfg.unknown_item_share) & (batch.items > 0)
    dense_negatives = dense_seen = None
    if dense_weight > 0:
        n_neg = tcfg.dense_negatives
        dense_negatives = torch.randint(1, model.cfg.num_items + 1, (n_neg,), generator=gen) if n_neg > 0 else None
        if tcfg.seen_negatives > 0:
            every = torch.arange(targets.shape[1]).expand_as(targets)
            dense_seen = seen_events(batch.items, every, tcfg.seen_negatives, gen)  # [B, N, h]

    share = {}
    if rows is not None:
        if len(rows) == 0:
            return {k: torch.zeros(()) for k in loss_names(tcfg)}
        # means over the global batch: each share divides its sum by the global count
        n_pos = int(valid.sum())
        share["retrieval"] = share["dense"] = int(valid[rows].sum()) / max(n_pos, 1)
        if tcfg.ranker_weight > 0:
            ranked = (positives > 0) & (pos < batch.lengths[:, None])  # what the ranker loss averages over
            n_ranked = int(ranked.sum())
            share["ranking"] = int(ranked[rows].sum()) / n_ranked if n_ranked else 0.0
            pos, positives, negatives = pos[rows], positives[rows], negatives[rows]
        batch = take_rows(batch, rows)
        if hidden is not None:
            hidden = hidden[rows, :batch.items.shape[1]]
        if dense_seen is not None:
            dense_seen = dense_seen[rows, :batch.items.shape[1]]

    device = model.backbone.item_embedding.weight.device
    batch = batch.to(device)
    if dense_negatives is not None:
        dense_negatives = dense_negatives.to(device)
    items = batch.items if hidden is None else batch.items.masked_fill(hidden.to(device), model.unknown_index)
    cache = model.backbone(items, batch.actions, batch.timestamps, batch.lengths)
    targets = batch.targets
    valid = targets > 0
    codes = model.codebook.codes[targets]  # [B, N, 4]
    logits = model.decoder.training_logits(cache.states, batch.lengths, codes, model.codebook, valid)
    out = {"retrieval": code_loss(model.codebook, logits, codes[valid], tcfg.code_loss)}
    if tcfg.ranker_weight > 0:
        out["ranking"] = tcfg.ranker_weight * model.ranker.training_loss(
            cache, pos.to(device), positives.to(device), negatives.to(device))
    if dense_weight > 0:
        seen = dense_seen.to(device)[valid] if dense_seen is not None else None
        out["dense"] = dense_weight * dense_loss(model, cache.states[valid], targets[valid], dense_negatives, seen)
    return {k: v * share[k] for k, v in out.items()} if share else out


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


def seen_events(items: torch.Tensor, positions: torch.Tensor, h: int, gen: torch.Generator) -> torch.Tensor:
    """`h` of each user's own events at or before each position, drawn uniformly with replacement:
    items [B, N], positions [B, P] -> [B, P, h]."""
    B, P = positions.shape
    at = (torch.rand(B, P, h, generator=gen) * (positions[..., None] + 1)).long()
    return items.gather(1, at.view(B, -1)).view(B, P, h)


def dense_loss(model: GenerativeRecommender, states, targets, negatives: torch.Tensor | None = None,
               seen: torch.Tensor | None = None):
    """CE of the next item by the dense head (states [P, D], targets [P]): over the whole catalog,
    or over the target and `negatives` [S] shared by the batch (a sampled softmax; a negative
    equal to the target is masked), which costs S / num_items of the full product. `seen` [P, h]:
    each position's own negatives (the user's earlier events), masked too where equal to the target."""
    if negatives is None:
        logits = model.dense_scores(states)
        if seen is None:
            return F.cross_entropy(logits, targets)
        # a full softmax already holds the seen items; their extra copies weigh them more
        pos = logits.gather(1, targets[:, None])
        neg = logits.gather(1, seen).masked_fill(seen == targets[:, None], float("-inf"))
        return torch.logsumexp(torch.cat([logits, neg], 1), 1).mean() - pos.mean()
    states, emb = model.dense_operands(states)
    pos = (states * emb[targets]).sum(-1, keepdim=True)  # [P, 1]
    neg = (states @ emb[negatives].T).masked_fill(negatives[None, :] == targets[:, None], float("-inf"))  # [P, S]
    parts = [pos, neg]
    if seen is not None:
        parts.append((states[:, None, :] * emb[seen]).sum(-1).masked_fill(seen == targets[:, None], float("-inf")))
    return F.cross_entropy(torch.cat(parts, 1), torch.zeros_like(targets))


def lr_scale(tcfg: TrainConfig, progress: float) -> float:
    """Learning-rate multiplier at `progress` in [0, 1] of the run."""
    if tcfg.lr_schedule == "constant":
        return 1.0
    if tcfg.lr_schedule != "cosine":
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {tcfg.lr_schedule!r}")
    lo = tcfg.lr_min_ratio
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def validation_due(tcfg: TrainConfig, epoch: int, done: float, last: bool) -> bool:
    """Whether epoch `epoch` ends with a validation: the last one, every one once `done` (the share
    of the run behind it) reaches tcfg.validate_from, and every validate_every-th one before."""
    return last or done >= tcfg.validate_from or (epoch + 1) % tcfg.validate_every == 0


def all_reduce_step(params: list, parts: dict, extras: list[float]) -> tuple[dict, list[float]]:
    """Sum the gradients of `params`, the loss values `parts` ({name: float}) and `extras` over the
    ranks, in one all-reduce; returns the summed (parts, extras) and leaves the summed gradients
    in the params.

    Explicit rather than DistributedDataParallel: the training loss goes through several methods
    of the model (backbone, decoder.training_logits, ranker.training_loss, dense head), not one
    forward() that DDP could wrap; which parameters get a gradient depends on the loss weights;
    and a rank whose share of a short last batch is empty has no forward pass to run at all,
    where DDP would wait for its gradients. The losses are already scaled to the global batch,
    so the gradients are summed, not averaged. A parameter that no rank gave a gradient keeps
    None, as in one process (AdamW then leaves it alone, weight decay included)."""
    device = params[0].device
    grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=device) for p in params]
    flags = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
    scalars = torch.tensor(list(parts.values()) + list(extras), dtype=torch.float32, device=device)
    flat = dist.all_reduce_sum_(torch.cat(grads + [flags, scalars]))
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p)
        offset += n
    has_grad = flat[offset:offset + len(params)] > 0
    for p, keep in zip(params, has_grad.tolist()):
        if not keep:
            p.grad = None
    offset += len(params)
    summed = flat[offset:].tolist()
    return dict(zip(parts, summed[: len(parts)])), summed[len(parts):]


def _fingerprint(data, model: GenerativeRecommender) -> str:
    """A digest of the training events and the semantic IDs: equal on every rank or the ranks
    would train on different data."""
    h = hashlib.sha256()
    for a in (data.offsets, data.items, data.actions, data.timestamps, model.codebook.codes.cpu().numpy()):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@contextmanager
def weights_in_use(params: list, averaged: list | None):
    """The averaged weights in the model while the block runs (validation, saving), then the
    trained ones back; without an average, the trained weights throughout."""
    if averaged is None:
        yield
        return
    with torch.no_grad():
        trained = [p.detach().clone() for p in params]
        torch._foreach_copy_(params, averaged)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_(params, trained)


def _save_train_state(path, model, opt, state: TrainState, tcfg: TrainConfig, gen, rng, averaged=None) -> None:
    """Rank 0 writes a checkpoint (loadable by GenerativeRecommender.load) whose metadata holds
    what resuming needs: optimizer, counters, every rank's RNG state. Every rank must call it
    (the ranks' RNG states are gathered)."""
    device = next(model.parameters()).device
    own = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    per_rank = dist.gather_objects(own)
    if not dist.is_main():
        return
    model.save(path, {"train_state": {
        "optimizer": opt.state_dict(),
        "step": state.step, "epoch": state.epoch, "seconds": state.seconds, "best_metric": state.best_metric,
        "averaged_weights": averaged,
        "history": state.history, "train_config": dict(vars(tcfg)),
        "rng": {"generator": gen.get_state(), "numpy": rng.bit_generator.state, "torch": per_rank},
    }}, fold_codes=False)


def _restore_train_state(path, model, opt, gen, rng, log, averaged=None) -> TrainState:
    blob = torch.load(path, map_location="cpu", weights_only=False)
    ts = blob["metadata"]["train_state"]
    model.load_state_dict(blob["state_dict"])
    opt.load_state_dict(ts["optimizer"])
    if averaged is not None and ts.get("averaged_weights") is not None:
        torch._foreach_copy_(averaged, ts["averaged_weights"])
    gen.set_state(ts["rng"]["generator"])
    rng.bit_generator.state = ts["rng"]["numpy"]
    per_rank = ts["rng"]["torch"]
    if len(per_rank) == dist.world_size():
        own = per_rank[dist.rank()]
        torch.set_rng_state(own["cpu"])
        device = next(model.parameters()).device
        if own["cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(own["cuda"], device)
    elif dist.is_main():
        # the data order and the sampled negatives still resume exactly; only the dropout masks differ
        log(f"state saved by {len(per_rank)} process(es), resumed on {dist.world_size()}: "
            "the dropout masks do not continue the saved RNG streams")
    return TrainState(step=ts["step"], epoch=ts["epoch"], seconds=ts["seconds"], best_metric=ts["best_metric"],
                      history=list(ts["history"]))


def train(
    model: GenerativeRecommender,
    data,
    tcfg: TrainConfig,
    minutes: float | None = None,
    evaluate_fn=None,  # callable(model) -> float (higher is better), run after each epoch (rank 0)
    checkpoint_path=None,
    log=print,
    state_path=None,  # written after every epoch: the checkpoint to resume from
    resume_from=None,  # a state_path of an earlier run: continue after its last epoch
) -> TrainState:
    """Train `model` in place; the best epoch (by evaluate_fn; without one, the last) goes to
    checkpoint_path.

    resume_from restores the weights, the optimizer, the step/epoch counters, the time spent (the
    time budget and a time-based learning-rate schedule go on from there), the best validation
    metric and the RNG states, so an interrupted run continues as if it had not stopped.
    Under torchrun (after distributed.init()) every rank calls this; rank 0 alone evaluates, logs
    and writes files, and its decisions (time budget, metric) are broadcast."""
    world, main = dist.world_size(), dist.is_main()
    if not main:
        log = lambda *a, **k: None  # noqa: E731
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(tcfg.seed)
    rng = np.random.default_rng(tcfg.seed)
    codes = model.codebook.codes.cpu()  # negatives are drawn on the CPU: the same draws on any device
    sampler = NegativeSampler(codes, model.cfg.num_items, model.cfg.ranker_hard_fraction)
    # the fused update: one kernel over every parameter, not a dozen small ops per parameter
    # (the optimizer step was 8% of a Beauty training step on the CPU; fused, under 2%)
    opt = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.98), fused=True)
    if world > 1:
        fingerprints = dist.gather_objects(_fingerprint(data, model))
        if not dist.broadcast_object(main and len(set(fingerprints)) == 1):  # every rank stops, none hangs
            raise RuntimeError("the ranks loaded different training data or semantic IDs")
        for p in params:  # built alike from the same seed; rank 0's weights make sure of it
            dist.broadcast_(p.data)
        minutes = dist.broadcast_object(minutes)
        # a dropout stream of its own per rank (one process keeps the global stream as it is)
        torch.manual_seed(tcfg.seed * 1000 + dist.rank() + 1)
    # weight averaging: the validated and saved weights follow the trained ones, lagging ~1/(1 - decay) steps
    averaged = [p.detach().clone() for p in params] if tcfg.ema_decay > 0 else None
    state = TrainState()
    first_epoch = 0
    if resume_from is not None:
        state = _restore_train_state(resume_from, model, opt, gen, rng, log, averaged)
        first_epoch = state.epoch + 1
        log(f"resumed from {resume_from}: epoch {state.epoch} done, step {state.step}")
    start = time.time() - state.seconds
    deadline = start + 60 * minutes if minutes else math.inf
    names = loss_names(tcfg)
    for epoch in range(first_epoch, tcfg.epochs):
        model.train()
        state.epoch = epoch
        sums = dict.fromkeys(names, 0.0)
        n, grad_norm = 0, 0.0
        epoch_start = time.time()
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
            disable=not main,
        )
        for batch in bar:
            elapsed = time.time() - start
            rows = dist.shard_rows(len(batch)) if world > 1 else None
            parts = losses(model, batch, sampler, tcfg, gen, rows)
            loss = sum(parts.values())
            opt.zero_grad(set_to_none=True)
            if loss.requires_grad:
                loss.backward()
            parts = {k: float(v.detach()) for k, v in parts.items()}
            over = time.time() > deadline
            if world > 1:
                # rank 0's clock decides for everyone: its elapsed time (learning rate) and its deadline
                parts, (elapsed, over) = all_reduce_step(params, parts, [elapsed if main else 0.0,
                                                                         float(main and over)])
                over = over > 0
            # progress: the larger of the time and epoch fractions (whichever ends the run first)
            progress = max(elapsed / (60 * minutes) if minutes else 0.0, epoch / tcfg.epochs)
            for group in opt.param_groups:
                group["lr"] = tcfg.lr * lr_scale(tcfg, progress)
            # clipped by the norm of the summed gradient: the same on every rank
            grad_norm += float(torch.nn.utils.clip_grad_norm_(params, 1.0))
            opt.step()
            if averaged is not None:
                with torch.no_grad():
                    torch._foreach_lerp_(averaged, params, 1.0 - tcfg.ema_decay)
            state.step += 1
            n += 1
            for k, v in parts.items():
                sums[k] += v
            if state.step % 20 == 0:
                bar.set_postfix({k: f"{v / n:.3f}" for k, v in sums.items()})
            if over:
                break
        epoch_seconds = time.time() - epoch_start
        state.seconds = time.time() - start
        state.history.append({"epoch": epoch, "steps": n, "train_seconds": round(epoch_seconds, 3),
                              "grad_norm": grad_norm / max(n, 1), **{k: v / max(n, 1) for k, v in sums.items()}})
        msg = " ".join(f"{k}={v / max(n, 1):.4f}" for k, v in sums.items())
        metric = None
        over = dist.broadcast_object(time.time() > deadline)
        if evaluate_fn is not None:
            done = max(state.seconds / (60 * minutes) if minutes else 0.0, (epoch + 1) / tcfg.epochs)
            if validation_due(tcfg, epoch, done, last=over or epoch + 1 == tcfg.epochs):
                with weights_in_use(params, averaged):
                    if main:
                        model.eval()
                        metric = evaluate_fn(model)
                    metric = dist.broadcast_object(metric)
                    state.history[-1]["valid"] = metric
                    if metric > state.best_metric:
                        state.best_metric = metric
                        if checkpoint_path and main:
                            model.save(checkpoint_path, {"epoch": epoch, "valid_metric": metric, "train_seconds": state.seconds})
        elif checkpoint_path and main:
            with weights_in_use(params, averaged):
                model.save(checkpoint_path, {"epoch": epoch, "train_seconds": state.seconds})
        if state_path:
            _save_train_state(state_path, model, opt, state, tcfg, gen, rng, averaged)
        log(f"epoch {epoch} [{state.seconds / 60:.1f} min] {msg}" + (f" valid={metric:.4f}" if metric is not None else ""))
        if metric is not None and not over:  # the budget can also run out during the validation
            over = dist.broadcast_object(time.time() > deadline)
        if over and epoch + 1 < tcfg.epochs:
            log(f"time budget of {minutes} min reached")
            break
    return state
