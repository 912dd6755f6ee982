"""`python -m megatron_mis.cli`."""
import sys

from megatron_mis.cli import main

sys.exit(main())
