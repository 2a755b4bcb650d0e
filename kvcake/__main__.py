import sys

from kvcake.cli import main

sys.exit(main())
