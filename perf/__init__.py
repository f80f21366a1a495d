"""Offline performance harness: decode, ranking and caching benchmarks, and their report."""
# OpenMP's wait policy is left to the environment. The offline benchmarks are meant to run alone
# on the machine, where the runtime's default (an idle thread spins briefly, then sleeps) is
# fastest; with other busy processes beside them, OMP_WAIT_POLICY=PASSIVE avoids spinning
# threads taking the cores the others need (perf/results/omp_wait_policy.txt measures both).
