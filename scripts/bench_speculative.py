"""`tandem bench speculative` as a script, as the docs name it:
tandem/bench/speculative.py, whose --help says what it measures."""

from tandem.bench.speculative import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
