"""`tandem bench host-step` as a script, as the docs name it:
tandem/bench/host_step.py, whose --help says what it measures."""

from tandem.bench.host_step import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
