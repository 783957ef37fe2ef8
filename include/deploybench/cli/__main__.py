"""``python -m deploybench.cli``: the same as the ``deploybench`` command."""

import sys

from deploybench.cli import main

sys.exit(main())
