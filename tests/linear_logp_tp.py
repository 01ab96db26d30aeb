"""The runbook's entry: ``torchrun --standalone --nproc_per_node=4 tests/linear_logp_tp.py [flags]``.

The program is :mod:`tplogp.runbook` (also ``torchrun ... -m tplogp.runbook``); ``--help`` lists every flag.
"""

import sys

from tplogp.runbook import main

if __name__ == "__main__":
    sys.exit(main())
