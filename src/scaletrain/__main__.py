"""`python -m scaletrain ...` and `torchrun -m scaletrain train ...`."""

import sys

from scaletrain.cli import main

sys.exit(main())
