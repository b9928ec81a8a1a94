"""``python -m trainmesh``: the command line, as the ``trainmesh`` script runs it (the launcher starts ranks so)."""

import sys

from trainmesh.app.entry import main

sys.exit(main())
