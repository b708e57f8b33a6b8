import sys

from fsdp_fp8.cli import main

sys.exit(main())
