"""The learning-rate schedule of training."""
from __future__ import annotations

import pytest

from backend_src.config import TrainConfig
from backend_src.training import lr_scale


def test_constant_schedule_keeps_the_rate():
    assert all(lr_scale(TrainConfig(), p) == 1.0 for p in (0.0, 0.3, 1.0, 2.0))


def test_cosine_schedule_decays_to_the_floor():
    tcfg = TrainConfig(lr_schedule="cosine", lr_min_ratio=0.05)
    scales = [lr_scale(tcfg, i / 20) for i in range(21)]
    assert scales[0] == pytest.approx(1.0) and scales[-1] == pytest.approx(0.05)
    assert scales[10] == pytest.approx(0.525)
    assert all(a > b for a, b in zip(scales, scales[1:]))
    assert lr_scale(tcfg, 1.5) == pytest.approx(0.05)  # past the budget: stays at the floor


def test_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_scale(TrainConfig(lr_schedule="step"), 0.5)


def test_sampled_dense_loss_over_every_item_is_the_full_softmax():
    """With every item as a shared negative (the target among them, masked) the sampled softmax is
    the softmax over the whole catalog; with a few negatives it is a smaller loss over fewer items."""
    import torch

    from backend_src.config import ModelConfig
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.model.semantic_ids import SemanticIdCodebook
    from backend_src.training import dense_loss

    torch.manual_seed(0)
    cfg = ModelConfig(num_items=40, d_model=16, num_layers=1, num_heads=2, max_seq_len=8)
    model = GenerativeRecommender(cfg, SemanticIdCodebook(), [None] + [str(i) for i in range(40)])
    states, targets = torch.randn(6, 16), torch.randint(1, 41, (6,))
    full = dense_loss(model, states, targets)
    assert torch.allclose(dense_loss(model, states, targets, torch.randperm(40) + 1), full, atol=1e-6)
    assert dense_loss(model, states, targets, torch.tensor([1, 2, 3])) < full
    # cosine / temperature: the same identity, and the scores are the normalized products
    model.cfg.dense_temperature = 0.05
    cos = dense_loss(model, states, targets)
    assert torch.allclose(dense_loss(model, states, targets, torch.randperm(40) + 1), cos, atol=1e-5)
    emb = torch.nn.functional.normalize(model.backbone.item_embedding.weight[1:41], dim=-1)
    logits = torch.nn.functional.normalize(states, dim=-1) @ emb.T / 0.05
    assert torch.allclose(cos, torch.nn.functional.cross_entropy(logits, targets - 1), atol=1e-5)


def test_seen_negatives_are_the_users_own_events_up_to_the_position():
    """Each draw is an event of that user at or before the position; a seen negative equal to the
    target is masked out of the dense head's softmax (repeat consumption is learned, not punished),
    and one that is not raises the loss."""
    import torch

    from backend_src.config import ModelConfig
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.model.semantic_ids import SemanticIdCodebook
    from backend_src.training import dense_loss, seen_events

    gen = torch.Generator().manual_seed(0)
    items = torch.arange(1, 61).view(3, 20)  # user b's event n is item 20 b + n + 1
    positions = torch.tensor([[0, 5], [19, 3], [7, 7]])
    drawn = seen_events(items, positions, 64, gen)
    assert drawn.shape == (3, 2, 64)
    at = drawn - 1 - 20 * torch.arange(3)[:, None, None]  # back to event indices
    assert bool((at >= 0).all()) and bool((at <= positions[..., None]).all())
    assert bool((drawn[0, 0] == 1).all())  # position 0: only the first event
    assert len(set(drawn[1, 0].tolist())) >= 16  # 64 draws reach most of its 20 events

    torch.manual_seed(0)
    cfg = ModelConfig(num_items=40, d_model=16, num_layers=1, num_heads=2, max_seq_len=8)
    model = GenerativeRecommender(cfg, SemanticIdCodebook(), [None] + [str(i) for i in range(40)])
    states, targets = torch.randn(6, 16), torch.randint(1, 41, (6,))
    shared = torch.tensor([1, 2, 3])
    base = dense_loss(model, states, targets, shared)
    assert torch.allclose(dense_loss(model, states, targets, shared, targets[:, None].repeat(1, 4)), base)
    others = (targets[:, None] % 40) + 1  # never the target
    assert dense_loss(model, states, targets, shared, others) > base
    full = dense_loss(model, states, targets)
    assert torch.allclose(dense_loss(model, states, targets, None, targets[:, None]), full, atol=1e-6)
    assert dense_loss(model, states, targets, None, others) > full


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_ranker_negatives_share_the_first_code_in_the_asked_fraction(fraction):
    """The first int(n * fraction) negatives of a positive share its first semantic-ID code, the
    rest are uniform over the catalog; a fraction outside [0, 1] is refused."""
    import torch

    from backend_src.training import NegativeSampler

    gen = torch.Generator().manual_seed(0)
    first = torch.arange(400) % 8  # items 1..400 in 8 first-code groups of 50
    codes = torch.cat([torch.tensor([[-1, -1, -1, -1]]), torch.stack([first, first, first, first], 1)])
    sampler = NegativeSampler(codes, 400, fraction)
    positives = torch.randint(1, 401, (64,), generator=gen)
    neg = sampler.sample(positives, 32, gen)
    assert neg.shape == (64, 32) and int(neg.min()) >= 1 and int(neg.max()) <= 400
    n_hard = int(32 * fraction)
    same = codes[neg, 0] == codes[positives, 0][:, None]
    assert bool(same[:, :n_hard].all())
    if n_hard < 32:  # uniform draws over 8 groups: about 1 in 8 share the code by chance
        assert float(same[:, n_hard:].float().mean()) < 0.3
    with pytest.raises(ValueError, match="hard_fraction"):
        NegativeSampler(codes, 400, 1.5)


def test_code_loss_over_valid_codes_is_the_softmax_beam_search_takes():
    """'valid': each level's cross-entropy is over the codes continuing the target's prefix, i.e.
    minus the log-probability a constrained beam step gives the target's code; a level whose
    prefix has one child adds 0; 'all' is the plain cross-entropy over every code."""
    import torch
    import torch.nn.functional as F

    from backend_src.model.semantic_ids import SemanticIdCodebook
    from backend_src.training import code_loss

    # items: (0,0,0,0) (0,0,1,0) (0,2,0,0) (1,1,0,0) (1,1,0,1); sizes 2 / 3 / 2 / 2
    cb = SemanticIdCodebook.from_codes(torch.tensor([[0, 0, 0, 0], [0, 0, 1, 0], [0, 2, 0, 0], [1, 1, 0, 0],
                                                     [1, 1, 0, 1]]))
    codes = cb.codes[1:]  # [5, 4]
    torch.manual_seed(0)
    logits = [torch.randn(5, c) for c in cb.codebook_sizes]
    plain = sum(F.cross_entropy(lt, codes[:, t]) for t, lt in enumerate(logits))
    assert torch.allclose(code_loss(cb, logits, codes, "all"), plain)

    # by hand: per item, the sibling codes at each level (the target's own included)
    siblings = {1: {0: [0, 2], 1: [1]}, 2: {(0, 0): [0, 1], (0, 2): [0], (1, 1): [0]},
                3: {(0, 0, 0): [0], (0, 0, 1): [0], (0, 2, 0): [0], (1, 1, 0): [0, 1]}}
    expected = F.cross_entropy(logits[0], codes[:, 0])  # every level-0 code continues some item
    for t in (1, 2, 3):
        terms = []
        for i, c in enumerate(codes.tolist()):
            key = c[0] if t == 1 else tuple(c[:t])
            allowed = siblings[t][key]
            terms.append(-torch.log_softmax(logits[t][i, allowed], 0)[allowed.index(c[t])])
        expected = expected + torch.stack(terms).mean()
    valid = code_loss(cb, logits, codes, "valid")
    assert torch.allclose(valid, expected, atol=1e-6)
    assert valid < plain  # fewer competitors at every level
    with pytest.raises(ValueError, match="'all' or 'valid'"):
        code_loss(cb, logits, codes, "siblings")


def test_level_prefixes_follow_the_codes_and_end_at_the_item():
    import torch

    from backend_src.model.semantic_ids import SemanticIdCodebook

    cb = SemanticIdCodebook.from_codes(torch.tensor([[0, 0, 0, 0], [0, 2, 0, 0], [1, 1, 0, 0]]))
    p = cb.level_prefixes(torch.tensor([[0, 2, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]]))
    assert p[:, 0].tolist() == [0, 0, 0]  # the root
    assert cb.items_of(p[:, -1]).tolist() == [2, 3, 0]  # (1, 0, ...) is no item
    assert p[2, 2].item() == -1  # it leaves every item at level 1


def test_byte_mask_dropout_keeps_the_expectation_at_the_rounded_rate():
    """Kept elements are scaled by 256 / (256 - round(256 p)), dropped ones are 0, the drop rate is
    round(256 p) / 256; the mask follows torch's seed; eval mode and p = 0 pass the input through."""
    import torch

    from backend_src.model.dropout import Dropout

    x = torch.ones(400_000)
    drop = Dropout(0.3).train()
    torch.manual_seed(0)
    y = drop(x)
    kept = y != 0
    assert abs((1 - kept.float().mean()) - 77 / 256) < 0.003
    assert torch.allclose(y[kept], torch.full_like(y[kept], 256 / 179))
    assert abs(float(y.mean()) - 1.0) < 0.01
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)
    assert not torch.equal(drop(x), y)  # the next call draws a new mask
    assert torch.equal(drop.eval()(x), x) and torch.equal(Dropout(0.0).train()(x), x)
    assert torch.equal(Dropout(1.0).train()(x), torch.zeros_like(x))
    # the gradient is the mask: the kept elements' scale, 0 elsewhere
    z = torch.randn(3, 1000, requires_grad=True)
    out = Dropout(0.5).train()(z)
    out.sum().backward()
    assert torch.equal(z.grad, (out != 0).float() * 2.0)
    with pytest.raises(ValueError, match="probability"):
        Dropout(1.5)


def test_validation_runs_late_in_the_run_and_on_every_fifth_epoch_before():
    from backend_src.training import validation_due

    tcfg = TrainConfig(epochs=55)
    due = [e for e in range(55) if validation_due(tcfg, e, (e + 1) / 55, last=e == 54)]
    assert due == [4, 9, 14, 19, 24] + list(range(27, 55))
    assert validation_due(tcfg, 0, 0.01, last=True)  # a run cut short by its time cap ends validated
    assert validation_due(tcfg, 2, 0.6, last=False)  # the time cap's share counts too


def test_the_kept_checkpoint_is_the_best_validated_epoch(tmp_path):
    """Epochs without a validation must not overwrite the best checkpoint."""
    import torch

    from backend_src.config import ModelConfig
    from backend_src.data.loaders import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.training import build_model, train

    data = load_dataset("synthetic:users=60,items=40,clusters=4,seed=0")
    cfg = ModelConfig(num_items=data.num_items, d_model=16, num_layers=1, num_heads=2, max_seq_len=16,
                      codebook_sizes=(4, 4, 4, 1))
    model = build_model(data, cfg, embedding_dim=8)
    metrics = iter([0.5, 0.2, 0.3])  # epochs 1, 3 and 4 (validate_every 2, the last)
    seen = []

    def evaluate_fn(m):
        seen.append(len(seen))
        return next(metrics)

    ckpt = tmp_path / "model.pt"
    state = train(model, data, TrainConfig(epochs=5, batch_size=16, validate_every=2, validate_from=2.0),
                  evaluate_fn=evaluate_fn, checkpoint_path=ckpt, log=lambda *a, **k: None)
    assert len(seen) == 3
    assert [h["epoch"] for h in state.history if "valid" in h] == [1, 3, 4]
    assert GenerativeRecommender.load(ckpt).metadata["epoch"] == 1
    assert state.best_metric == 0.5
    assert torch.isfinite(torch.tensor([h["retrieval"] for h in state.history])).all()


def test_weight_averaging_validates_and_saves_the_average_and_trains_on(tmp_path):
    """With ema_decay the validated and saved weights are the average (at a decay near 1 it stays at the
    initial weights), and training goes on from the trained ones."""
    import torch

    from backend_src.config import ModelConfig
    from backend_src.data.loaders import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.training import build_model, train

    data = load_dataset("synthetic:users=60,items=40,clusters=4,seed=0")
    cfg = ModelConfig(num_items=data.num_items, d_model=16, num_layers=1, num_heads=2, max_seq_len=16,
                      codebook_sizes=(4, 4, 4, 1))
    model = build_model(data, cfg, embedding_dim=8)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    validated = []
    ckpt = tmp_path / "model.pt"
    train(model, data, TrainConfig(epochs=2, batch_size=16, validate_from=0.0, ema_decay=1 - 1e-9),
          evaluate_fn=lambda m: validated.append({k: v.clone() for k, v in m.state_dict().items()}) or len(validated),
          checkpoint_path=ckpt, log=lambda *a, **k: None)
    saved = GenerativeRecommender.load(ckpt).state_dict()
    name = "backbone.item_embedding.weight"
    for weights in (validated[0], validated[1], saved):
        torch.testing.assert_close(weights[name], initial[name], atol=1e-6, rtol=0)
    assert (model.state_dict()[name] - initial[name]).abs().max() > 1e-3  # the trained weights, back in the model


def test_the_recipe_fills_what_no_flag_gives():
    """Any data set gets the recipe (history length and item embeddings by rule); the small
    benchmark data sets their pinned configurations; a flag always wins."""
    from types import SimpleNamespace

    import numpy as np

    from export import train as train_cli

    def events(counts):
        return SimpleNamespace(offsets=np.concatenate([[0], np.cumsum(counts)]))

    assert train_cli.history_length(events([3] * 100)) == 50
    assert train_cli.history_length(events([120] * 100)) == 150
    assert train_cli.history_length(events([5] * 99 + [2000])) == 50  # the 99th percentile, not the longest
    assert train_cli.history_length(events([2000] * 100)) == 512

    args = train_cli.parse_args(["--data", "some/where/amazon-toys", "--lr", "1e-3"])
    filled = train_cli.resolve_settings(args, events([7] * 100))
    assert args.lr == 1e-3 and "lr" not in filled
    recipe = train_cli.RECIPE
    assert (args.epochs, args.minutes, args.d_model, args.max_len) == (recipe["epochs"], recipe["minutes"], 96, 50)
    assert filled["lr_schedule"] == "cosine" and args.code_embeddings == 3 and args.node_output is True
    assert args.covisit_window == 3  # the served order's co-visitation expert
    assert args.item_embeddings == "collaborative"  # no item text: co-occurrence
    args = train_cli.parse_args(["--data", "amazon-toys", "--no-node-output"])
    train_cli.resolve_settings(args, events([7] * 100))
    assert args.node_output is False
    with_text = SimpleNamespace(**vars(events([7] * 100)), item_text={1: "a caliper"})
    args = train_cli.parse_args(["--data", "amazon-tools"])
    train_cli.resolve_settings(args, with_text)
    assert args.item_embeddings == "text-encoder"
    args = train_cli.parse_args(["--data", "amazon-tools", "--item-embeddings", "text"])
    train_cli.resolve_settings(args, with_text)
    assert args.item_embeddings == "text"

    args = train_cli.parse_args(["--data", "ml-1m", "--minutes", "28"])
    train_cli.resolve_settings(args, with_text)
    assert (args.d_model, args.max_len, args.codebook, args.minutes) == (64, 512, (64, 64, 64), 28)
    assert args.item_embeddings == "auto" and args.code_embeddings == 0  # as its recorded results were trained
    assert args.node_output is False and args.covisit_window == 0
    args = train_cli.parse_args(["--data", "ml-1m", "--recipe", "--max-len", "2048"])  # the recipe, not the benchmark's
    train_cli.resolve_settings(args, with_text)
    assert (args.d_model, args.max_len, args.codebook, args.node_output) == (96, 2048, (256, 256, 256), True)
    assert args.covisit_window == 3 and args.item_embeddings == "text-encoder"
    args = train_cli.parse_args(["--data", "amazon-beauty", "--minutes", "0"])
    train_cli.resolve_settings(args, events([7] * 100))
    assert args.minutes is None  # no time cap
