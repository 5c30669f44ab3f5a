"""`tandem bench kernels` as a script, as the docs name it:
tandem/bench/kernels.py, whose --help says what it measures."""

from tandem.bench.kernels import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
