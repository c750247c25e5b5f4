"""``python -m r3lab``: the command line (see ``r3lab.cli``); with no arguments, the drift experiment."""

from r3lab.cli import main

if __name__ == "__main__":
    main()
