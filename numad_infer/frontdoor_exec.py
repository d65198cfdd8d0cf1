"""What numa-infer-frontdoor.service runs: `python3 -m numad_infer.frontdoor_exec SOCKET -- haproxy ...`.

The code is numad_infer/frontdoor/handover.py. This name stays because every unit rendered
so far, by this version and by older ones, names it: an upgraded package must still start
the front door before the daemon renders its units again.
"""

from __future__ import annotations

import sys

from numad_infer.frontdoor.handover import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
