import sys

from fsdp_fp8.cli.commands import main

sys.exit(main())
