"""``python -m tandem``: the ``tandem`` command (tandem/cli.py) without its console script."""

from tandem.cli import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
