"""`tandem bench offline` as a script, as the docs name it:
tandem/bench/offline.py, whose --help says what it measures."""

from tandem.bench.offline import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
