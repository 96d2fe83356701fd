"""`python -m simplefsdp.train` (what torchrun runs: `torchrun ... -m simplefsdp.train [flags]`)."""

import sys

from simplefsdp.train.cli import main

sys.exit(main())
