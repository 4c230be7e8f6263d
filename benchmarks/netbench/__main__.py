import sys

from benchmarks.netbench.cli import main

sys.exit(main())
