"""The final refit: trained on the validation targets too, so nothing may be chosen on them."""
import pytest

from backend_src.model.recommender import GenerativeRecommender
from export import baselines, train
from export import evaluate as evaluate_cli
from serving_helpers import build_tiny_checkpoint


def test_model_refit_takes_the_fusion_weight_of_a_validation_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--out", "m.pt", "--refit"])
    assert "--fusion-weight" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--out", "m.pt", "--refit", "--fusion-weight", str(tmp_path / "missing.pt")])
    assert "neither a number nor a checkpoint" in capsys.readouterr().err
    assert train.parse_args(["--out", "m.pt", "--refit", "--fusion-weight", "0.5"]).fusion_weight == ((0.5, 0.0, 0.0), (0.5, 0.0, 0.0))
    checkpoint = tmp_path / "valid_run.pt"
    build_tiny_checkpoint(checkpoint, item_ids=[None, *range(1, 41)], max_history=16, seed=0)
    model = GenerativeRecommender.load(checkpoint)
    # as export.evaluate --tune-fusion saves them: (ranker, dense) weights per seen-item policy
    model.cfg.set_fusion_weights((0.75, 0.25, 1.0), (1.5, 0.5, 2.0))
    model.save(checkpoint)
    args = train.parse_args(["--out", "m.pt", "--refit", "--fusion-weight", str(checkpoint)])
    assert args.fusion_weight == ((0.75, 0.25, 1.0), (1.5, 0.5, 2.0))
    # a final fit trained before the weights existed gets all four from the validation run
    final = tmp_path / "final.pt"
    build_tiny_checkpoint(final, item_ids=[None, *range(1, 41)], max_history=16, seed=1)
    evaluate_cli.save_fusion_weights(GenerativeRecommender.load(final), final, args.fusion_weight)
    cfg = GenerativeRecommender.load(final).cfg
    assert (cfg.fusion_weights(False), cfg.fusion_weights(True)) == ((0.75, 0.25, 1.0), (1.5, 0.5, 2.0))


def test_sasrec_refit_runs_its_epochs_and_skips_validation():
    result = baselines.main(["--data", "synthetic", "--model", "sasrec", "--refit", "--epochs", "2",
                             "--hidden", "16", "--blocks", "1", "--max-len", "16"])
    details = result["details"]
    assert details["epochs_run"] == 2 and details["best_epoch"] == 2
    assert details["valid"] is None and details["trained_on"] == "all but the test target"
    assert all("ndcg@10" not in row for row in details["history"])
    assert [r["seen_excluded"] for r in result["rows"]] == [False, True]
