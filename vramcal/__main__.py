"""``python -m vramcal``."""

from vramcal.cli import main

if __name__ == "__main__":
    main()
