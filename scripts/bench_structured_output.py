"""`tandem bench structured-output` as a script, as the docs name it:
tandem/bench/structured_output.py, whose --help says what it measures."""

from tandem.bench.structured_output import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
