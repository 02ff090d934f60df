"""`python -m client`: the mlxserve command-line client."""

import sys

from client.cli import main

sys.exit(main())
