"""The three-seed quality tables are printed from the committed result files."""
import pytest

from perf.common import RESULTS_DIR
from perf.experiments.quality_seeds import DATASETS, summarize


@pytest.mark.parametrize("data", list(DATASETS))
def test_each_table_is_what_its_result_files_give(data):
    table, rows = summarize(data)
    assert table == (RESULTS_DIR / f"{data.split('-')[-1]}_seeds.md").read_text()
    assert {(r["order"], r["seen"]) for r in rows} == {
        (o, s) for o in ("retrieval", "served", "sasrec") for s in ("included", "excluded")}


def test_a_variant_replaces_our_rows_and_keeps_sasrec():
    recipe, _ = summarize("amazon-scientific")
    variant, _ = summarize("amazon-scientific", "scientific_trial_rq_vae_collaborative_codes")
    sasrec = [line for line in recipe.splitlines() if line.startswith("| SASRec")]
    assert sasrec and all(line in variant.splitlines() for line in sasrec)
    ours = [line for line in recipe.splitlines() if line.startswith("| ours")]
    assert not any(line in variant.splitlines() for line in ours)
