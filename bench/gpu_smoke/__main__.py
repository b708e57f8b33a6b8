"""``python -m bench.gpu_smoke``: the driver (``bench.gpu_smoke.driver``)."""

from bench.gpu_smoke.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
