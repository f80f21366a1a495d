# The project's commands. `make setup` once, then `make demo`, `make test`, `make bench`.
PY          ?= .venv/bin/python
DATA        ?= synthetic
RUNS        ?= runs
LOCUST_VENV ?= .venv-locust
export PATH := $(CURDIR)/.venv/bin:$(PATH)
# OpenMP's wait policy: a process alone on the cores (training, the offline benchmarks) runs fastest
# with the runtime's default (an idle thread spins briefly, then sleeps); where processes share the
# cores (tests and the demo beside a tritonserver, the served benchmark) idle threads must sleep at
# once, or they take the cores the others need. Both measured: perf/results/omp_wait_policy.txt
SHARED_CORES := OMP_WAIT_POLICY=PASSIVE
# glibc keeps freed memory for reuse (no first-touch page faults on every large tensor);
# the same settings as the server's CPU_RUNTIME_ENV
export MALLOC_MMAP_THRESHOLD_ ?= 33554432
export MALLOC_TRIM_THRESHOLD_ ?= 4294967296
export MALLOC_TOP_PAD_ ?= 268435456

.PHONY: setup test test-fast demo bench bench-offline bench-served bench-catalog bench-sessions bench-writers bench-scaleout bench-gpu check-triton36 train-beauty train-beauty-refit train-scientific baselines-beauty train-ml1m ablation-ml1m clean

## setup: the pinned environment (torch 2.13.0 CPU build, Triton server 2.51 from nvidia-pytriton)
setup: .venv/.installed

.venv/.installed: requirements.txt requirements-nodeps.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip==24.3.1
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	touch $@

$(LOCUST_VENV)/.installed: perf/locust_requirements.txt
	test -x $(LOCUST_VENV)/bin/python || python3 -m venv $(LOCUST_VENV)
	$(LOCUST_VENV)/bin/pip install -q -r perf/locust_requirements.txt
	touch $@

## test: unit, kernel (Triton interpreter) and integration tests against a real tritonserver
test: setup
	$(SHARED_CORES) $(PY) -m pytest -q tests

test-fast: setup
	$(SHARED_CORES) $(PY) -m pytest -q tests -m "not server"

## demo: train a small model on $(DATA), publish it, serve it, query it over gRPC, shut down
demo: setup
	$(SHARED_CORES) $(PY) -m examples.demo --data $(DATA) --dir $(RUNS)/demo

# The benchmarks measure what ships: the recipe's models (served: every expert on, the fused order's
# weights for lists without seen items). Amazon Beauty (history 50) is `python -m export.train` as a
# user runs it; ML-1M is the recipe at histories up to 2048 (its latency, not its quality: a 10-minute
# run, batches of 32 at that length).
RECIPE_BEAUTY := $(RUNS)/beauty/model.pt
RECIPE_LONG   := $(RUNS)/ml1m-recipe/model.pt

$(RECIPE_BEAUTY): | setup
	$(PY) -m export.train --data amazon-beauty --out $@

$(RECIPE_LONG): | setup
	$(PY) -m export.train --data ml-1m --recipe --max-len 2048 --batch-size 32 --minutes 10 --valid-users 200 \
		--test-users 200 --out $@

## bench: offline benchmarks (decode, ranking, caching: random models of the papers' sizes, then the recipe's
## trained model), then the served ones (perf_analyzer, locust)
bench: bench-offline bench-served

bench-offline: setup $(RECIPE_LONG)
	$(PY) -m perf.bench
	$(PY) -m perf.bench_decode --checkpoint $(RECIPE_LONG) --reps 21 --phase-runs 10
	$(PY) -m perf.bench_ranking --threads 2 --checkpoint $(RECIPE_LONG)
	$(PY) -m perf.bench_caching --threads 2 --checkpoint $(RECIPE_LONG)

$(RUNS)/bench/model.pt: | setup
	$(PY) -m export.train --data ml-1m --max-len 512 --epochs 1 --minutes 1 --max-users 600 \
		--valid-users 50 --test-users 50 --out $@

# BASELINE_REF=<commit>: the same models served by that commit's code side by side, every measurement in turn
SERVED = $(SHARED_CORES) $(PY) -m perf.served --beam-width 100 --pfa-k 256 --exclude-seen $(if $(QUICK),--quick) \
		$(if $(BASELINE_REF),--baseline-ref $(BASELINE_REF))
bench-served: setup $(LOCUST_VENV)/.installed $(RECIPE_BEAUTY) $(RECIPE_LONG)
	$(SERVED) --checkpoint $(RECIPE_BEAUTY) --data amazon-beauty --histories 50 --check-users 0 \
		--locust --locust-bin $(LOCUST_VENV)/bin/locust --out perf/results/served_recipe.json
	$(SERVED) --checkpoint $(RECIPE_LONG) --data ml-1m --histories 50 512 2048 --requests 100 \
		--out perf/results/served_recipe_long.json
	$(PY) -m perf.report

## the living catalog: cold start (Amazon Scientific and ML-1M, 10% of the items held out of training, then added
## through the catalog), unknown items in traffic, add costs (two replicas: needs redis-server and nginx) (~2 h)
bench-catalog: setup
	for d in amazon-scientific ml-1m; do r=$$([ $$d = ml-1m ] && echo --recipe); \
		$(PY) -m export.train --data $$d $$r --hold-out-items 0.1 --out $(RUNS)/catalog-$$d-cold/model.pt || exit 1; \
		$(PY) -m export.train --data $$d $$r --out $(RUNS)/catalog-$$d-full/model.pt || exit 1; \
	done
	$(PY) -m perf.bench_catalog --data amazon-scientific --checkpoint $(RUNS)/catalog-amazon-scientific-cold/model.pt --tune
	$(SHARED_CORES) $(PY) -m perf.bench_catalog --data amazon-scientific --checkpoint $(RUNS)/catalog-amazon-scientific-cold/model.pt \
		--ceiling $(RUNS)/catalog-amazon-scientific-full/model.pt --cluster
	$(SHARED_CORES) $(PY) -m perf.bench_catalog --data ml-1m --checkpoint $(RUNS)/catalog-ml-1m-cold/model.pt \
		--ceiling $(RUNS)/catalog-ml-1m-full/model.pt --many 0 --add-to

## sessions at scale (100,000 users, a 1,000,000-user log), under faults, and the event log's cost (~40 min)
bench-sessions: setup
	$(SHARED_CORES) $(PY) -m perf.bench_sessions faults
	$(SHARED_CORES) $(PY) -m perf.bench_sessions log-cost
	$(SHARED_CORES) $(PY) -m perf.bench_sessions scale

## concurrent writers of shared sessions under forced timeouts and faults: every acknowledged event logged
## exactly once, in each writer's order (Jepsen-style; needs Debian's redis-server and nginx, ~8 min)
bench-writers: setup
	$(SHARED_CORES) $(PY) -m perf.bench_writers

## two replicas behind nginx with a Redis log, real ML-1M users (needs Debian's redis-server and nginx)
bench-scaleout: setup $(RUNS)/bench/model.pt
	$(SHARED_CORES) $(PY) -m perf.bench_scaleout --checkpoint $(RUNS)/bench/model.pt --data ml-1m --max-users 600

## the kernels under triton 3.6 (the GPU host's release): interpreter tests + sm_90 compile
check-triton36: setup
	$(PY) -m pip install -q --no-deps --target $(RUNS)/triton36 triton==3.6.0
	PYTHONPATH=$(RUNS)/triton36 $(PY) -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_compile.py

## on a GPU host (its own python3 with torch + triton): kernels against the reference, bandwidth vs peak,
## whole decode eager and as CUDA graphs, ranking, caching -> perf/results/gpu
bench-gpu:
	bash perf/gpu_run.sh perf/results/gpu

## the README's quality results (long runs). `python -m export.train --data NAME` trains the recipe
## (export/train.py RECIPE: 12 epochs, capped at 30 minutes; any flag overrides its setting)

## train-beauty: the recipe, its epoch and fusion weight chosen on the validation split
train-beauty: setup
	$(PY) -m export.train --data amazon-beauty --out $(RUNS)/beauty/model.pt
	$(PY) -m export.evaluate --checkpoint $(RUNS)/beauty/model.pt --data amazon-beauty --out perf/results/quality_beauty.json

## train-beauty-refit: the same recipe's final fit, trained on the validation targets too (after train-beauty),
## seeds 0-2 (seed 0 without a file suffix), each evaluated on the test split
train-beauty-refit: setup $(RUNS)/beauty/model.pt
	for s in 0 1 2; do sfx=$$([ $$s = 0 ] || echo _seed$$s); \
		$(PY) -m export.train --data amazon-beauty --refit --fusion-weight $(RUNS)/beauty/model.pt --seed $$s \
			--out $(RUNS)/beauty-refit$$sfx/model.pt --results perf/results/quality_beauty_refit_recipe$$sfx.json || exit 1; \
	done

## train-scientific: Amazon Scientific, the recipe and SASRec beside it, seeds 0-2 (seed 0 without a file suffix)
train-scientific: setup
	for s in 0 1 2; do sfx=$$([ $$s = 0 ] || echo _seed$$s); \
		$(PY) -m export.train --data amazon-scientific --seed $$s --out $(RUNS)/scientific-text-encoder$$sfx/model.pt \
			--results perf/results/quality_scientific_text_encoder$$sfx.json || exit 1; \
		$(PY) -m export.baselines --data amazon-scientific --model sasrec --epochs 200 --minutes 28 --seed $$s \
			--out perf/results/baseline_sasrec_scientific$$sfx.json || exit 1; \
	done
	$(PY) -m export.baselines --data amazon-scientific --model covisitation --threads 1 \
		--out perf/results/baseline_covisitation_scientific.json
	$(PY) -m perf.experiments.quality_seeds

## baselines-beauty: popularity; co-visitation counts; SASRec, its epoch chosen on validation; then its final fit for that many epochs
SASREC_BEAUTY := perf/results/baseline_sasrec_beauty_28min.json
baselines-beauty: setup
	$(PY) -m export.baselines --data amazon-beauty --model popularity --threads 1 --out perf/results/baseline_popularity_beauty.json
	$(PY) -m export.baselines --data amazon-beauty --model covisitation --refit --threads 1 \
		--out perf/results/baseline_covisitation_beauty.json
	$(PY) -m export.baselines --data amazon-beauty --model sasrec --epochs 200 --minutes 28 --out $(SASREC_BEAUTY)
	$(PY) -m export.baselines --data amazon-beauty --model sasrec --refit --minutes 60 \
		--epochs $$($(PY) -c "import json; print(json.load(open('$(SASREC_BEAUTY)'))['details']['best_epoch'])") \
		--out perf/results/baseline_sasrec_beauty_refit.json

train-ml1m: setup
	$(PY) -m export.train --data ml-1m --max-len 512 --alpha 1.6 --batch-size 64 --lr 2e-3 --valid-users 600 \
		--minutes 28 --out $(RUNS)/ml1m/model.pt --results perf/results/quality_ml1m.json
	$(PY) -m export.train --data ml-1m --max-len 512 --alpha 1.6 --batch-size 64 --lr 2e-3 --valid-users 600 \
		--minutes 28 --shared-kv --out $(RUNS)/ml1m-shared/model.pt --results perf/results/quality_ml1m_shared_kv.json

ablation-ml1m: setup
	$(PY) -m export.ablation --data ml-1m --checkpoint $(RUNS)/ml1m/model.pt \
		--shared-checkpoint $(RUNS)/ml1m-shared/model.pt --out perf/results/ablation_ml1m.json
	$(PY) -m export.ablation --data ml-1m --checkpoint $(RUNS)/ml1m/model.pt --min-events 256 --no-stats \
		--shared-checkpoint $(RUNS)/ml1m-shared/model.pt --out perf/results/ablation_ml1m_long.json
	$(PY) -m export.ablation --data amazon-beauty --checkpoint $(RUNS)/beauty/model.pt --max-users 3000 \
		--only "PFA (s=1, k=256, r=0.5)" --out perf/results/attention_beauty.json

clean:
	rm -rf $(RUNS) .pytest_cache
