"""Train the generative recommender (HSTU backbone + PFA decoder head + M-FALCON ranker head).

    python -m export.train --data PATH          # the recipe (RECIPE), -> runs/<name>/model.pt

Builds the semantic IDs, trains with validation checks (after every epoch in the second half of
the run; keeping the best checkpoint), chooses the served order's fusion weight on validation,
then evaluates on the test split over the full catalog and writes a result file. Any flag
overrides its setting of the recipe.

--refit --fusion-weight W (or the validation run's checkpoint): the final fit of a recipe chosen
on validation. Every event but each user's test target is trained on (the validation targets too,
as the HSTU public code trains); there is no validation left, so the run keeps its last epoch and
takes W from the validation run.

Data-parallel training on several processes (gloo on CPUs, NCCL with --device cuda, one GPU
per process):

    torchrun --standalone --nproc_per_node 2 -m export.train --data ml-100k --out runs/ml100k/model.pt

(`python -m torch.distributed.run` is the same launcher.) --batch-size stays the global batch:
each process trains on its share of every batch and the gradients are summed over the processes,
so a step equals the single-process step on the same batch. Rank 0 alone builds the semantic IDs
(sent to the others), validates, decides the time budget, writes the checkpoint and evaluates
at the end. Run as one plain process, nothing of this happens.

After every epoch the training state (weights, optimizer, counters, RNG states) goes to
<out>.state.pt (model.pt -> model.state.pt); --resume runs/x/model.state.pt continues an
interrupted run after its last finished epoch, with the same flags (a larger --epochs or
--minutes extends a finished one). The model's configuration comes from the state file.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import numpy as np

from backend_src import distributed
from backend_src.config import DecodeOptions, ModelConfig, TrainConfig
from backend_src.data.loaders import hold_out_items, load_dataset
from backend_src.evaluation import evaluate
from backend_src.metrics import METRIC_NAMES
from backend_src.model.recommender import GenerativeRecommender
from backend_src.model.semantic_ids import ITEM_EMBEDDING_SOURCES, QUANTIZERS
from backend_src.results import write_result
from backend_src.training import build_model, train
from export.evaluate import fusion_weights, result_rows, tune_fusion

# The recipe: what `python -m export.train --data PATH` trains when no flag says otherwise, on any
# data set (chosen on Amazon Beauty's validation split: docs/results.md). What has to follow the
# data follows it by rule: the history kept (history_length) and the budget, in epochs, so that the
# cost follows the number of events; `minutes` caps it (the cosine schedule then ends with the clock).
RECIPE = dict(
    d_model=96, layers=2, heads=2, dropout=0.3, codebook=(256, 256, 256),
    lr=2e-3, lr_schedule="cosine", weight_decay=0.1, dense_negatives=1024, ranker_negatives=32,
    code_embeddings=3, node_output=True, covisit_window=3, valid_users=4000, epochs=12, minutes=30.0,
    unknown_item_share=0.02,
)
# The small models of the speed benchmarks, the tests and the demo: fixed sizes and the settings
# their recorded results were trained with (perf/results/*.json "command"), not quality recipes.
_SMALL = dict(layers=2, heads=2, dropout=0.2, lr=1e-3, lr_schedule="constant", weight_decay=0.0,
              dense_negatives=0, ranker_negatives=64, code_embeddings=0, node_output=False, covisit_window=0,
              valid_users=2000, minutes=None, item_embeddings="auto", unknown_item_share=0.0)
BENCHMARK_CONFIGS = {
    "synthetic": dict(_SMALL, d_model=48, max_len=64, codebook=(32, 32, 32), epochs=4),
    "ml-100k": dict(_SMALL, d_model=64, max_len=200, codebook=(32, 32, 32), epochs=30),
    "ml-1m": dict(_SMALL, d_model=64, max_len=512, codebook=(64, 64, 64), epochs=30),
}


def history_length(data) -> int:
    """Events of history the model keeps: the 99th percentile of the users' event counts, rounded
    up to a multiple of 50, within [50, 512] (Amazon Beauty and Scientific: 50)."""
    counts = np.diff(np.asarray(data.offsets))
    p99 = float(np.percentile(counts, 99)) if len(counts) else 0.0
    return int(min(512, max(50, 50 * math.ceil(p99 / 50))))


def item_embedding_source(data) -> str:
    """What the recipe's semantic IDs are fit on: the item text through the pretrained sentence
    encoder where the data has text (on Amazon Scientific's validation split it beat TF-IDF + SVD:
    docs/results.md), else co-occurrence in the training events."""
    return "text-encoder" if getattr(data, "item_text", None) else "collaborative"


def data_name(spec: str) -> str:
    return Path(spec.split(":")[0]).name


def resolve_settings(args, data) -> dict:
    """Fill in every setting no flag gave (args attributes left None): a benchmark configuration's
    for the data sets that have one (unless --recipe), else the recipe's, with the history length
    and the item embeddings by rule. Returns the settings filled in."""
    small = None if getattr(args, "recipe", False) else BENCHMARK_CONFIGS.get(data_name(args.data))
    settings = small or dict(
        RECIPE, max_len=history_length(data), item_embeddings=item_embedding_source(data))
    filled = {}
    for key, value in settings.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
            filled[key] = value
    if args.minutes is not None and args.minutes <= 0:  # --minutes 0: no time cap
        args.minutes = None
    return filled


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="synthetic", help="data set name under ../shared/data, a path, or 'synthetic'")
    p.add_argument("--out", default=None, help="checkpoint path (.pt; default runs/<data set name>/model.pt)")
    p.add_argument("--recipe", action="store_true",
                   help="the recipe's settings also for a data set with a benchmark configuration (synthetic, ml-100k, ml-1m)")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"time cap of the run (recipe: {RECIPE['minutes']:g}; 0: none)")
    p.add_argument("--epochs", type=int, help=f"epochs (recipe: {RECIPE['epochs']}), the cosine schedule's length")
    p.add_argument("--d-model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--max-len", type=int)
    p.add_argument("--codebook", type=int, nargs="+",
                   help="sizes of the residual k-means levels (recipe: 256 256 256); a semantic ID has one code "
                        "per level and a last, collision code")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"],
                   help="cosine: decay the learning rate to 5%% over the epochs (or the time cap, if it comes first)")
    p.add_argument("--weight-decay", type=float, help="AdamW decoupled weight decay")
    p.add_argument("--ema-decay", type=float, default=TrainConfig.ema_decay,
                   help="validate and save an exponential moving average of the weights, this decay per step (0: off)")
    p.add_argument("--dropout", type=float)
    p.add_argument("--alpha", type=float, default=2.0, help="stochastic length alpha (2 = off)")
    p.add_argument("--decoder-heads", type=int, default=ModelConfig.decoder_heads,
                   help="attention heads of the semantic-ID decoder's cross-attention")
    p.add_argument("--node-output", action=argparse.BooleanOptionalAction, default=None,
                   help="decoding steps after the first also score each code by a learned vector of the prefix it "
                        f"makes (recipe: {'on' if RECIPE['node_output'] else 'off'})")
    p.add_argument("--covisit-window", type=int, metavar="EVENTS",
                   help="the served order's co-visitation expert counts pairs of training events within this many "
                        f"events of each other (recipe: {RECIPE['covisit_window']}; 0: no such expert)")
    p.add_argument("--shared-kv", action="store_true", help="PFA ablation: one K/V projection for all steps")
    p.add_argument("--ranker-weight", type=float, default=1.0)
    p.add_argument("--ranker-positions", type=int, default=1,
                   help="history positions per user at which a training batch ranks candidates (recipe: 1)")
    p.add_argument("--dense-weight", type=float, default=TrainConfig.dense_weight,
                   help="weight of the auxiliary dense loss (0: off)")
    p.add_argument("--dense-negatives", type=int,
                   help="sampled softmax for the dense head with this many shared uniform negatives (0: whole catalog)")
    p.add_argument("--dense-temperature", type=float, default=0.0,
                   help="> 0: the dense head scores cosine similarity / this temperature (0: dot product)")
    p.add_argument("--ranker-negatives", type=int, help="sampled negatives per ranker positive")
    p.add_argument("--seen-negatives", type=int, default=0,
                   help="per scored position, negatives drawn from the user's own earlier events, for the ranker (of "
                        "its negatives) and the dense head (beside its own)")
    p.add_argument("--ranker-hard-fraction", type=float, default=0.5,
                   help="share of the ranker negatives drawn among items sharing the positive's first code")
    p.add_argument("--item-embeddings", choices=ITEM_EMBEDDING_SOURCES,
                   help="what the semantic IDs are fit on (recipe: text-encoder where the data has item text, else "
                        "collaborative): text-encoder = the item text through a pretrained sentence encoder; text = "
                        "its TF-IDF + SVD; collaborative = co-occurrence in the training events; auto = text where "
                        "the data has it, else collaborative; text+collaborative = both side by side")
    p.add_argument("--balanced-codes", action="store_true",
                   help="each residual k-means level holds at most ceil(items / codes) items a code (not the recipe)")
    p.add_argument("--quantizer", choices=QUANTIZERS, default="kmeans",
                   help="how the item embeddings become codes: residual k-means (the recipe) or a learned "
                        "residual quantizer (rq-vae), optionally pulled toward the items' co-occurrence embeddings "
                        "(rq-vae-collaborative); measured variants, not the recipe")
    p.add_argument("--hold-out-items", type=float, default=0.0, metavar="SHARE",
                   help="train without this share of the items (chosen by --seed; their events removed), to measure "
                        "cold start: the catalog adds them to the published version (perf.bench_catalog)")
    p.add_argument("--unknown-item-share", type=float, metavar="P",
                   help="share of the history's events shown as the unknown item in training, which learns the vector "
                        f"an event on an item the served version does not know is encoded with (recipe: "
                        f"{RECIPE['unknown_item_share']})")
    p.add_argument("--code-embeddings", type=int, metavar="LEVELS",
                   help="while training, add to each item's vector the embeddings of the first LEVELS codes of "
                        f"its semantic ID, folded into the item table in the checkpoint (recipe: "
                        f"{RECIPE['code_embeddings']}; 0: off)")
    p.add_argument("--code-loss", choices=["all", "valid"], default="all",
                   help="each level's cross-entropy over all codes, or only those continuing the target's prefix "
                        "(the codes constrained beam search normalizes over)")
    p.add_argument("--valid-users", type=int,
                   help="users in the per-epoch validation check (a fixed random sample)")
    p.add_argument("--test-users", type=int, default=None, help="limit the final test evaluation")
    p.add_argument("--max-users", type=int, default=None, help="load only the first N users")
    p.add_argument("--beam", type=int, default=100)
    p.add_argument("--results", default=None, help="result JSON (default: next to the checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="train on the CPU or a GPU (under torchrun: one GPU per process, NCCL)")
    p.add_argument("--resume", default=None, metavar="STATE",
                   help="continue the run whose training state is this file (<out>.state.pt of that run)")
    p.add_argument("--refit", action="store_true",
                   help="train on validation targets too (only the test target held out); keep the last epoch")
    p.add_argument("--fusion-weight", type=fusion_weights, default=None, metavar="W|CHECKPOINT",
                   help="the served order's weights (required with --refit): a ranker weight (no other weight), or "
                        "the checkpoint of the validation run that chose them")
    args = p.parse_args(argv)
    if args.refit and args.fusion_weight is None:
        p.error("--refit has no validation split to choose the fusion weight on: give --fusion-weight")
    return args


def state_path(out) -> Path:
    """Where a run keeps its training state for --resume: model.pt -> model.state.pt."""
    return Path(out).with_suffix(".state.pt")


def main(argv=None):
    args = parse_args(argv)
    device = distributed.init(args.device)  # joins torchrun's process group, if launched by it
    try:
        run(args, device)
    finally:
        distributed.destroy()


def run(args, device):
    main_rank = distributed.is_main()
    say = print if main_rank else (lambda *a, **k: None)
    data = load_dataset(args.data, max_users=args.max_users)
    if args.hold_out_items:
        full = data
        data, held = hold_out_items(data, args.hold_out_items, args.seed)
        say(f"held out {len(held)} of {full.num_items} items ({args.hold_out_items:.0%}, seed {args.seed}): "
            f"{full.num_events - data.num_events} events removed")
    filled = resolve_settings(args, data)
    if args.out is None:
        args.out = str(Path("runs") / data_name(args.data) / "model.pt")
    say("settings no flag gave: " + ", ".join(f"{k}={v}" for k, v in filled.items()))
    tcfg = TrainConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        weight_decay=args.weight_decay,
        stochastic_length_alpha=args.alpha,
        ranker_weight=args.ranker_weight,
        ranker_positions=args.ranker_positions,
        end_offset=1 if args.refit else 2,
        code_loss=args.code_loss,
        seed=args.seed,
        dense_weight=args.dense_weight,
        dense_negatives=args.dense_negatives,
        seen_negatives=args.seen_negatives,
        ema_decay=args.ema_decay,
        unknown_item_share=args.unknown_item_share,
    )
    say(f"{data.name}: {data.num_users} users, {data.num_items} items, {len(data.items)} events")
    if args.resume:
        # the resumed run's model: configuration, semantic IDs and weights come from its state
        model = GenerativeRecommender.load(args.resume)
        cfg = model.cfg
        say(f"resuming {args.resume}: model configuration from the state file")
    else:
        cfg = ModelConfig(
            num_items=data.num_items,
            d_model=args.d_model,
            num_layers=args.layers,
            num_heads=args.heads,
            max_seq_len=args.max_len,
            dropout=args.dropout,
            codebook_sizes=tuple(args.codebook) + (1,),
            decoder_heads=args.decoder_heads,
            shared_kv_projection=args.shared_kv,
            ranker_negatives=args.ranker_negatives,
            ranker_hard_fraction=args.ranker_hard_fraction,
            dense_temperature=args.dense_temperature,
            code_embedding_levels=args.code_embeddings,
            covisit_window=args.covisit_window,
        )
        model = build_model(data, cfg, seed=args.seed, end_offset=tcfg.end_offset, item_embeddings=args.item_embeddings,
                            balanced_codes=args.balanced_codes, quantizer=args.quantizer,
                            node_output=args.node_output, log=say)
    if args.fusion_weight is not None:
        cfg.set_fusion_weights(*args.fusion_weight)
    say(f"semantic IDs: codebook sizes {cfg.codebook_sizes}")
    say(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    if distributed.is_distributed():
        say(f"data parallel: {distributed.world_size()} processes, {distributed.backend_for(device)}, "
            f"global batch {tcfg.batch_size}")
    model.to(device)
    valid_opts = DecodeOptions(mode="full", beam_width=min(args.beam, 50))

    # a fixed random sample: the first users of a file are often not typical (Beauty's are harder)
    valid_users = np.sort(np.random.default_rng(args.seed).permutation(data.num_users)[: args.valid_users])

    def valid_metric(m):  # called on rank 0 only
        if device.type != "cpu":  # the evaluation runs on the CPU
            m = copy.deepcopy(m).cpu()
        r = evaluate(m, data, "valid", valid_opts, users=valid_users, progress=False)
        summary = {k: round(v["ndcg@10"], 4) for k, v in r.items() if k.endswith("seen_included")}
        print("  valid ndcg@10:", json.dumps(summary))
        return max(r["retrieval/seen_included"]["ndcg@10"], r["ranked/seen_included"]["ndcg@10"])

    world = distributed.world_size()
    state = train(model, data, tcfg, minutes=args.minutes, evaluate_fn=None if args.refit else valid_metric,
                  checkpoint_path=args.out, state_path=state_path(args.out), resume_from=args.resume, log=say)
    distributed.destroy()  # what follows is rank 0's alone
    if not main_rank:
        return
    best = GenerativeRecommender.load(args.out)
    test_opts = DecodeOptions(mode="pfa", beam_width=args.beam)
    if args.ranker_weight > 0 and args.fusion_weight is None:
        print(f"rank fusion weights (validation): {tune_fusion(best, data, args.out, test_opts)}")
    test = evaluate(best, data, "test", test_opts, max_users=args.test_users)
    rows = result_rows(data.name, test, "pfa")
    out = Path(args.results or Path(args.out).with_suffix(".results.json"))
    write_result(
        out, rows, config=cfg.to_dict(), train=vars(tcfg), train_seconds=state.seconds, epochs_run=state.epoch + 1,
        best_valid=state.best_metric, timing=test["timing"], processes=world, train_history=state.history,
        resumed_from=args.resume, item_embeddings=args.item_embeddings, balanced_codes=args.balanced_codes,
        quantizer=args.quantizer, held_out_items=args.hold_out_items,
    )
    for r in rows:
        print(f"{r['model']:>18} seen_excluded={r['seen_excluded']!s:5} "
              + " ".join(f"{k}={r[k]:.4f}" for k in METRIC_NAMES))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
