from __future__ import annotations

import sys

from aiodist._cli import main

sys.exit(main())
