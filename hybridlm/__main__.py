import sys

from hybridlm.cli import main

sys.exit(main())
