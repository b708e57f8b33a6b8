"""The server's life on every rank, its settings already checked (``cli.serving`` parses them):

the process group (under torchrun), the launcher's one mesh
-> rank 0: the job store (records a previous server left are served again)
-> the engine (``generation.loading.load_engine``: the launcher's own load)
-> rank 0: the HTTP thread (uvicorn), which answers /health 200 from here on
-> every rank's loop (``serve.worker``) until SIGTERM (a drain) or a lost rank
-> leave through ``shutdown_distributed`` (docs/shutdown.md): 0 after a drain, 1 after a loss
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from fsdp_fp8.generation.values import RunSettings
from fsdp_fp8.serve.settings import ServeSettings

log = logging.getLogger("fsdp_fp8")


def serve(settings: RunSettings, serve_settings: ServeSettings) -> int:
    """The whole server on this rank; under torchrun it never returns (``shutdown_distributed``)."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[fsdp_fp8] %(message)s")
    from fsdp_fp8.load.preflight import start_process_group
    from fsdp_fp8.runtime.shutdown import shutdown_distributed

    if "RANK" in os.environ:
        start_process_group(settings.timeout)
    code = serve_ranks(settings, serve_settings)
    shutdown_distributed(code)
    return code


def serve_ranks(settings: RunSettings, serve_settings: ServeSettings, on_listening=None) -> int:
    """This rank's server, the process group (if any) already up: 0 after a drain, 1 after a lost
    rank or a failed load. ``on_listening(port)``: called on rank 0 once HTTP listens."""
    from fsdp_fp8.collective import rank_and_world
    from fsdp_fp8.errors import PeerLostError, ProblemsError
    from fsdp_fp8.runtime.heartbeat import stall_s_for, watch_peers
    from fsdp_fp8.serve.jobs import JobStore
    from fsdp_fp8.serve.worker import LOST_GRACE_S, ServerState, Worker

    rank = rank_and_world()[0]
    state, store, http = ServerState(), None, None
    output_dir = Path(serve_settings.output_dir).absolute()
    if rank == 0:
        store = JobStore(output_dir, serve_settings.max_queue)
        restored = store.restore()
        if restored:
            log.info("%d job record(s) found in %s, served again", restored, output_dir)
    previous = _on_sigterm(lambda: _drain(state))
    try:
        with watch_peers(stall_s=stall_s_for(settings.timeout), what="while serving"):
            engine, root = _load(settings)
            if rank == 0:
                http = _start_http(state, store, settings, serve_settings, engine, root, on_listening)
            state_here = state if rank == 0 else None
            Worker(engine, output_dir, settings.timeout, store, state_here, serve_settings.drain_s).run()
    except (PeerLostError, ProblemsError, OSError, RuntimeError) as exc:
        message = str(exc) if isinstance(exc, ProblemsError) else f"{type(exc).__name__}: {exc}"
        print(f"error{'' if rank == 0 else f' (rank {rank})'}: {message}", file=sys.stderr, flush=True)
        if store is not None:
            state.lost = message
            store.fail_unfinished("rank_lost", message)
            if http is not None:
                time.sleep(LOST_GRACE_S)  # /health answers 503 meanwhile
        return 1
    finally:
        state.stopped.set()
        if http is not None:
            http.should_exit = True
        _restore_sigterm(previous)
    if rank == 0:
        log.info("stopped: the running jobs ended, the queued ones were cancelled")
    return 0


def _on_sigterm(action):
    """Run ``action()`` on SIGTERM (where this thread may set handlers); the handler replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda *_: action())


def _restore_sigterm(previous) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


def _load(settings: RunSettings):
    """The launcher's load (its mesh, its options) of ``--checkpoint`` or the demo: (the engine,
    the checkpoint's directory or None for the demo)."""
    from fsdp_fp8.collective import distributed, rank_and_world
    from fsdp_fp8.format.hub import resolve_hub_path
    from fsdp_fp8.generation.demo import demo_checkpoint
    from fsdp_fp8.generation.loading import agree_on_run_settings, load_engine
    from fsdp_fp8.load.options import LoadOptions
    from fsdp_fp8.runtime.parallel_layout import ParallelLayout
    from fsdp_fp8.runtime.parallel_mesh import build_mesh

    path = settings.checkpoint or demo_checkpoint()
    agree_on_run_settings(settings, path)  # before the mesh: ranks given different settings stop here
    mesh = None
    if distributed():
        layout = ParallelLayout(rank_and_world()[1], settings.cfg_parallel, settings.ulysses, settings.replicas)
        mesh = build_mesh(layout, LoadOptions().device.type)
    options = LoadOptions(mesh=mesh.weights if mesh is not None else None, timeout_s=settings.timeout)
    given = {"attention_backend"} if settings.attention_backend != "native" else set()
    engine = load_engine(path, settings, mesh=mesh, options=options, given=given)
    return engine, (resolve_hub_path(settings.checkpoint) if settings.checkpoint else None)


def _start_http(state, store, settings, serve_settings, engine, root, on_listening):
    """Rank 0's HTTP server in a thread (uvicorn), once it listens; its port is printed."""
    import uvicorn

    from fsdp_fp8.format.pipeline_config import read_pipeline_factors
    from fsdp_fp8.generation.inputs import demo_factors
    from fsdp_fp8.serve.app import Served, make_app

    factors = demo_factors() if root is None else read_pipeline_factors(root, [])
    model = root.name if root is not None else "fsdp_fp8-demo"
    served = Served(
        store, state, settings, serve_settings, model, root, factors.temporal or 1, held_bytes(engine.device)
    )
    config = uvicorn.Config(make_app(served), host=serve_settings.host, port=serve_settings.port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="fsdp_fp8-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not thread.is_alive():
        raise OSError(f"the HTTP server could not listen on {serve_settings.host}:{serve_settings.port}")
    port = server.servers[0].sockets[0].getsockname()[1]
    log.info("serving %s on http://%s:%d (the OpenAI Videos API at /v1; a page at /)", model, serve_settings.host, port)
    if on_listening is not None:
        on_listening(port)
    return server


def held_bytes(device):
    """What ``/metrics`` reports rank 0 holds: CUDA's allocated bytes, or on the CPU every live
    tensor's storage (each counted once): what a leak would grow."""
    import gc

    import torch

    def held() -> int:
        if device.type == "cuda":
            return torch.cuda.memory_allocated(device)
        seen, total = set(), 0
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                try:
                    storage = getattr(obj, "_local_tensor", obj).untyped_storage()
                    pointer, size = storage.data_ptr(), storage.nbytes()
                except (RuntimeError, NotImplementedError, TypeError):  # no one storage of its own
                    continue
                if pointer not in seen:
                    seen.add(pointer)
                    total += size
        return total

    return held


def _drain(state) -> None:
    """SIGTERM: stop admitting (``/health`` and ``POST`` answer 503); rank 0's loop cancels the
    queued jobs and gives the running round its grace. A signal handler takes no lock: it may
    run while this thread holds the job store's."""
    if state.draining_since is None:
        state.draining_since = time.monotonic()


__all__ = ["held_bytes", "serve", "serve_ranks"]
