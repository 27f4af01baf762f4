from __future__ import annotations

import sys

from aiodist._launch.cli import main

sys.exit(main())
