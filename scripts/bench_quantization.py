"""`tandem bench quantization` as a script, as the docs name it:
tandem/bench/quantization.py, whose --help says what it measures."""

from tandem.bench.quantization import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
