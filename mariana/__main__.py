"""`python -m mariana ...`: the `mariana` command."""
import sys

from mariana.cli import main

sys.exit(main())
