"""Importing this module calls ``sys.exit``, which must not end the process that loads it."""

import sys

sys.exit("broken on purpose: this plug-in exits at import")
