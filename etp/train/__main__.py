"""``python -m etp.train`` (and ``torchrun -m etp.train``): the ``etp-train`` command."""
import sys

from etp.train.main import main

if __name__ == "__main__":
    sys.exit(main())
