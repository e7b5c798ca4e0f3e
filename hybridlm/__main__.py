from hybridlm.cli import main
import sys
sys.exit(main())
