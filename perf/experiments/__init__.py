"""One-off experiments kept runnable on the current code: each answers one question the docs cite
and writes its result into perf/results. What each measures and how to run it: README.md here."""
