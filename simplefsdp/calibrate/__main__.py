"""`python -m simplefsdp.calibrate` (e.g. under torchrun): the same as `simplefsdp calibrate`."""

import sys

from simplefsdp.calibrate.cli import main

sys.exit(main())
