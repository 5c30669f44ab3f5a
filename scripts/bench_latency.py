"""`tandem bench latency` as a script, as the docs name it:
tandem/bench/latency.py, whose --help says what it measures."""

from tandem.bench.latency import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
