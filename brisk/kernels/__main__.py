import sys

from brisk.kernels import main

sys.exit(main())
