"""Data-parallel training (export.train under torchrun): a step on 2 processes equals the step of
one process on the same global batch, rank 0 alone evaluates and writes, and a resumed run equals
an uninterrupted one."""
from __future__ import annotations

import multiprocessing
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from backend_src import distributed
from backend_src.config import ModelConfig, TrainConfig
from backend_src.data.loaders import load_dataset
from backend_src.data.sequences import length_bucketed, train_batches
from backend_src.model.recommender import GenerativeRecommender
from backend_src.training import NegativeSampler, build_model, losses, train

# 37 users: one global batch of 64 holds them all, split 19 / 18 over two ranks
SPEC = "synthetic:users=37,items=60,clusters=4,seed=3"


def tiny_model(dropout: float = 0.0):
    data = load_dataset(SPEC)
    cfg = ModelConfig(num_items=data.num_items, d_model=16, num_layers=1, num_heads=2, max_seq_len=12,
                      codebook_sizes=(4, 4, 4, 1), dropout=dropout, ranker_negatives=8)
    return data, build_model(data, cfg, embedding_dim=16, seed=0)


def one_step_config() -> TrainConfig:
    # every loss term, the shared dense negatives and stochastic length (random draws of every kind)
    return TrainConfig(epochs=1, batch_size=64, stochastic_length_alpha=1.6,
                       extra={"dense_weight": 1.0, "dense_negatives": 5})


def quiet(*args, **kwargs):
    pass


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point() and a[k].numel())


def _rank_main(rank: int, world: int, port: int, out: str):
    """One rank of the 2-process runs; its results go to out/rank{rank}.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    distributed.init("cpu", timeout_minutes=2)
    try:
        out = Path(out)
        data, model = tiny_model()
        step = train(model, data, one_step_config(), log=quiet)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}  # summed, clipped
        result = {"params": model.state_dict(), "grads": grads, "step": step.step, "history": step.history}

        # rank 0's time budget (spent after a step) and validation decide for both ranks; each rank
        # is given its own file names, so a file a rank 1 wrote would show
        data, model = tiny_model()
        calls = []

        def metric(m):
            calls.append(1)
            return 0.1 * len(calls)

        budget = train(model, data, TrainConfig(epochs=3, batch_size=16), minutes=1e-4 if rank == 0 else None,
                       evaluate_fn=metric, checkpoint_path=out / f"best{rank}.pt",
                       state_path=out / f"state{rank}.pt", log=quiet)
        result.update(evaluations=len(calls), epoch=budget.epoch, steps=budget.step, best=budget.best_metric)
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        distributed.destroy()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
    for p in procs:
        if p.is_alive():  # a rank left waiting on the other: fail, don't hang
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_shards_of_a_batch_sum_to_the_whole_batch_loss_and_gradient():
    """In one process: the loss terms of each rank's share (same generator state) sum to the
    whole batch's terms, and so do their gradients; an empty share draws the same numbers."""
    data, model = tiny_model()
    tcfg = one_step_config()
    start = torch.Generator().manual_seed(0).get_state()
    batch = next(length_bucketed(train_batches(data, 64, 12, 0, stochastic_length_alpha=1.6), 64,
                                 np.random.default_rng(0)))
    sampler = NegativeSampler(model.codebook.codes, data.num_items)

    def terms_and_grads(rows):
        gen = torch.Generator().set_state(start)
        model.zero_grad(set_to_none=True)
        parts = losses(model, batch, sampler, tcfg, gen, rows)
        total = sum(parts.values())
        if total.requires_grad:
            total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return {k: float(v.detach()) for k, v in parts.items()}, grads, gen.get_state()

    whole, whole_grads, whole_gen = terms_and_grads(None)
    shares = [terms_and_grads(distributed.shard_rows(len(batch), r, 3)) for r in range(3)]
    assert sorted(torch.cat([distributed.shard_rows(len(batch), r, 3) for r in range(3)]).tolist()) == \
        list(range(len(batch)))
    for k in whole:
        assert sum(s[0][k] for s in shares) == pytest.approx(whole[k], rel=1e-5)
    for name, g in whole_grads.items():
        summed = sum(s[1][name] for s in shares if name in s[1])
        assert torch.allclose(summed, g, atol=1e-6, rtol=1e-4), name
    empty = terms_and_grads(torch.arange(0))
    assert not empty[1] and all(torch.equal(s[2], whole_gen) for s in shares + [empty])


def test_two_processes_take_the_single_process_step(two_ranks):
    """The 2-rank step (gloo) leaves the weights the single process leaves after its step on the
    same global batch, with the same logged loss terms; both ranks hold the same weights. (Adam's
    first step is about lr * sign(gradient), so the gradients and their norm are compared too.)"""
    _, (r0, r1) = two_ranks
    data, model = tiny_model()
    single = train(model, data, one_step_config(), log=quiet)
    assert single.step == r0["step"] == r1["step"] == 1
    assert max_difference(r0["params"], r1["params"]) == 0.0
    # The ranker's output bias shifts every candidate's logit alike, which its softmax over the candidates
    # ignores: its gradient is 0 up to rounding, and Adam's first step (about lr * sign) follows the rounding.
    shift = "ranker.head.2.bias"
    assert float(r0["grads"][shift].abs().max()) < 1e-6
    weights = max_difference({k: v for k, v in model.state_dict().items() if k != shift}, r0["params"])
    assert weights < 1e-5
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == r0["grads"].keys()
    gradients = max_difference(grads, r0["grads"])
    assert gradients < 1e-5
    for name, value in single.history[0].items():
        if name not in ("epoch", "steps", "train_seconds"):  # the loss terms and the gradient norm
            assert r0["history"][0][name] == pytest.approx(value, rel=1e-5), name


def test_rank_zero_alone_validates_and_writes_and_both_stop_together(two_ranks):
    out, (r0, r1) = two_ranks
    assert (out / "best0.pt").exists() and (out / "state0.pt").exists()
    assert not (out / "best1.pt").exists() and not (out / "state1.pt").exists()
    assert (r0["evaluations"], r1["evaluations"]) == (1, 0)  # the budget ran out in epoch 0
    assert r0["epoch"] == r1["epoch"] == 0 and r0["steps"] == r1["steps"] >= 1
    assert r0["best"] == r1["best"]  # rank 0's metric, broadcast
    assert GenerativeRecommender.load(out / "best0.pt").metadata["epoch"] == 0


class Interrupted(Exception):
    pass


def test_resuming_equals_training_without_a_stop(tmp_path):
    """2 epochs at once == epoch 0, a crash, --resume, epoch 1: weights, optimizer, the data
    order, the sampled negatives and the dropout masks all continue where they stopped."""
    tcfg = TrainConfig(epochs=2, batch_size=16, lr_schedule="cosine", stochastic_length_alpha=1.6)
    data, model = tiny_model(dropout=0.1)
    whole = train(model, data, tcfg, log=quiet)

    def crash_after_epoch_0(msg):
        if msg.startswith("epoch 0"):
            raise Interrupted

    data, first = tiny_model(dropout=0.1)
    state = tmp_path / "model.state.pt"
    with pytest.raises(Interrupted):
        train(first, data, tcfg, state_path=state, log=crash_after_epoch_0)
    torch.manual_seed(123)  # a new process's RNG: the resumed run must not depend on it
    resumed = GenerativeRecommender.load(state)  # as export.train --resume builds it
    again = train(resumed, data, tcfg, state_path=state, resume_from=state, log=quiet)
    assert (again.epoch, again.step) == (whole.epoch, whole.step) == (1, whole.step)
    assert [h["steps"] for h in again.history] == [h["steps"] for h in whole.history]
    assert again.history[1]["retrieval"] == pytest.approx(whole.history[1]["retrieval"], rel=1e-5)
    weights = max_difference(model.state_dict(), resumed.state_dict())
    assert weights < 1e-5
