"""``python -m tpkernels.train``: the same as ``tpkernels train``."""

import sys

from tpkernels.train.cli import main

if __name__ == "__main__":  # --nproc's spawned ranks import this module again (as __mp_main__)
    sys.exit(main())
