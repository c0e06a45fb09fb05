"""``python -m multiattn.conformance``: the conformance runner."""

import sys

from .runner import main

sys.exit(main())
