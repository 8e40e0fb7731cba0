"""`python -m scaletrain ...` and `torchrun -m scaletrain train ...`."""

import sys

from scaletrain.console import main

sys.exit(main())
