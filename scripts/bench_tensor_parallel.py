"""`tandem bench tensor-parallel` as a script, as the docs name it:
tandem/bench/tensor_parallel.py, whose --help says what it measures."""

from tandem.bench.tensor_parallel import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
