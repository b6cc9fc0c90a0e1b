"""``python -m demo``: see the package docstring."""

from demo import main

if __name__ == "__main__":
    main()
