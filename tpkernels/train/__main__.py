"""``python -m tpkernels.train``: the same as ``tpkernels train``."""

import sys

from tpkernels.train.cli import main

sys.exit(main())
