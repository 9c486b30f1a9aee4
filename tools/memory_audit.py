#!/usr/bin/env python
"""Same as the ``etp-audit`` console script: predicted per-rank memory with and without ETP.

    python tools/memory_audit.py --recipe recipes/moe_flagship.yaml --plot audit.png
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from etp.train.audit_command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
