"""`tandem bench serving` as a script, as the docs name it:
tandem/bench/serving.py, whose --help says what it measures."""

from tandem.bench.serving import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
