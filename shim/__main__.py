"""``python -m shim``: the same as the ``vmsandbox`` command."""

import sys

from cli.main import main

sys.exit(main())
