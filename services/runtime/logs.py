"""Logging, configured once by the CLI; modules use logging.getLogger(__name__)."""
from __future__ import annotations

import logging
import os
import sys


def setup_logging(verbosity: int = 0) -> None:
    """INFO by default, DEBUG with -v, WARNING with -q; MARIANA_LOG_LEVEL overrides."""
    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    named = os.environ.get("MARIANA_LOG_LEVEL", "").upper()
    if named in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        level = getattr(logging, named)
    logging.basicConfig(
        level=level, stream=sys.stderr, force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
