"""How loud the server's processes are: ``meshserve serve --log-level``, applied in each of them.

The CLI puts the level in ``MESHSERVE_LOG_LEVEL``; Ray starts every worker of a local cluster with
the driver's environment, and each replica and host actor applies it when it starts. meshserve's
own progress lines (loading, warm-up, ready) are printed, not logged, so they show at every level.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_LEVEL_ENV = "MESHSERVE_LOG_LEVEL"
DEFAULT_LEVEL = "warning"
# Libraries that log at WARNING about nothing a server's operator can act on.
_NOISY = ("torch.utils.cpp_extension",)


def configure_process_logging() -> None:
    """Set meshserve's loggers (and the noisy libraries') to the server's level."""
    level = os.environ.get(LOG_LEVEL_ENV, DEFAULT_LEVEL).upper()
    logger = logging.getLogger("meshserve")
    logger.setLevel(level)
    if not logger.handlers:
        # Its own handler, and no propagation: libraries may configure the root logger too, and
        # a record must print once.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if level not in ("DEBUG", "INFO"):
        for name in _NOISY:
            logging.getLogger(name).setLevel(logging.ERROR)
