"""The benchmarks: ``tandem bench NAME [ARGS]`` runs ``tandem/bench/NAME.py``'s ``main`` (a
hyphen in NAME for each underscore), as ``python scripts/bench_NAME.py [ARGS]`` does."""
