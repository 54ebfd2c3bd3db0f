"""``python -m shim``: the same as the ``vmsandbox`` command."""

import sys

from shim.admin.cli import main

sys.exit(main())
