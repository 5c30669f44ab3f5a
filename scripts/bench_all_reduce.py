"""`tandem bench all-reduce` as a script, as the docs name it:
tandem/bench/all_reduce.py, whose --help says what it measures."""

from tandem.bench.all_reduce import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
