import sys

from numad_infer.cli import main

sys.exit(main())
