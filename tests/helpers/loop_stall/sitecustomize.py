"""Test-only: starve a `prefixroute extproc` process's event loop on demand (tests/integration/reliability/
test_starved_router.py).

Python imports ``sitecustomize`` at start-up from the first folder on its path that has one: a test puts this
folder on ``PYTHONPATH`` and names a file in ``PREFIXROUTE_TEST_LOOP_STALL_FILE``. In a process started as
``python -m prefixroute extproc`` (every other process is left alone), the router's event loop then runs a task
that, while the file exists, blocks the loop for the number of seconds the file holds (default 0.2) and yields,
again and again: every loop iteration lasts that long, as in a router whose host is starved of CPU. Without the
file it checks again every 50 ms and costs nothing else.
"""

import os
import sys

_FILE = os.environ.get("PREFIXROUTE_TEST_LOOP_STALL_FILE")

if _FILE and sys.argv[1:2] == ["extproc"]:
    import asyncio
    import time

    import prefixroute.extproc.server as _server

    async def _stall(path: str) -> None:
        while True:
            try:
                with open(path) as f:
                    stall_s = float(f.read().strip() or 0.2)
            except (OSError, ValueError):
                await asyncio.sleep(0.05)
                continue
            time.sleep(stall_s)  # blocks the loop on purpose: the starvation under test
            await asyncio.sleep(0)

    _new_event_loop = _server.new_event_loop
    _tasks: set = set()  # a running task must be referenced, or it may be collected

    def _stalling_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
        loop = _new_event_loop(use_uvloop)
        loop.call_soon(lambda: _tasks.add(loop.create_task(_stall(_FILE), name="test loop stall")))
        return loop

    _server.new_event_loop = _stalling_loop
