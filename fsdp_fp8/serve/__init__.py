"""Serving: load once under torchrun, then run every request over HTTP (the OpenAI Videos API
shape). Rank 0 answers HTTP; every rank runs the rounds rank 0 hands out (``serve.worker``) on the
library's engine (``fsdp_fp8.generation``). Needs the ``serve`` extra (FastAPI, uvicorn,
prometheus-client, python-multipart). docs/usage.md, "Serving"."""
