"""`python -m megatron_mis` runs the command line."""
import sys

from megatron_mis.cli import main

sys.exit(main())
