import sys

from numad_infer.cli.main import main

sys.exit(main())
