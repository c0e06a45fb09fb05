"""Run the benchmark from a checkout: ``python benchmarks/run.py [options]``.

The same as ``multiattn bench [options]``; the code lives in `multiattn.bench` so that the
command works after ``pip install``. See ``benchmarks/README.md``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from multiattn.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
