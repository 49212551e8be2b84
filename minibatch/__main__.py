"""`python -m minibatch ...`: the command line (tools/cli.py)."""

from .tools.cli import main

if __name__ == "__main__":
    main()
