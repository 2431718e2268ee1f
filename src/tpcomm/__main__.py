"""``python -m tpcomm ...`` is the ``tpcomm`` command."""

import sys

from .cli import main

sys.exit(main())
