"""scripts/walk_modules.py's counting rules, on functions that live in stand-in router modules (their globals name
a `prefixroute.*` module, so the tracer takes them for the router's): what is an entry, a re-entry, a call into a
transport from below, what is background, and a stream's walk bound to its handler's task. The script's walk of the
real router is tests/integration/core/test_core_scripts_walk.py."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("walk_modules", ROOT / "scripts" / "walk_modules.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


wm = _load_script()

SERVICER = "prefixroute.extproc.servicer"
ROUTER = "prefixroute.extproc.routing.router"
TRACKING = "prefixroute.extproc.tracking"
POOL = "prefixroute.extproc.endpoints.pool"


def in_module(module: str, source: str, **names: Any) -> dict[str, Any]:
    """The functions `source` defines, as if module `module` defined them (`names`: its globals)."""
    namespace: dict[str, Any] = {"__name__": module, "asyncio": asyncio, **names}
    exec(compile(source, f"<{module}>", "exec"), namespace)  # noqa: S102 - the test's own source
    return namespace


def stand_ins() -> dict[str, Any]:
    """A transport (servicer) over a router core that calls it back, a tracking helper, a pool probe."""
    tracking = in_module(TRACKING, "def note():\n    return inner()\ndef inner():\n    return 1\n")
    router = in_module(ROUTER, "def decide(callback):\n    return callback() + 1\n"
                               "async def later():\n    return decide(lambda: 0)\n")
    servicer = in_module(SERVICER, "def handle():\n    return decide(lambda: 1) + note()\n"
                                   "async def handle_async():\n"
                                   "    task = asyncio.get_running_loop().create_task(later())\n"
                                   "    return await task\n",
                         decide=router["decide"], note=tracking["note"], later=router["later"])
    pool = in_module(POOL, "def probe():\n    return 2\n")
    return {"handle": servicer["handle"], "handle_async": servicer["handle_async"], "probe": pool["probe"]}


def sequence(walk: Any) -> list[tuple[str, str, str]]:
    return [(wm.short(e.caller), wm.short(e.module), e.function) for e in walk.entries]


async def test_entries_reentries_and_a_transport_called_back_from_below() -> None:
    f = stand_ins()
    walk = wm.Walk("t")
    with wm.ModuleTracer().window(walk):
        f["handle"]()
        f["probe"]()  # a call no transport made: background
    assert sequence(walk) == [
        ("outside", "extproc.servicer", "handle"),
        ("extproc.servicer", "extproc.routing.router", "decide"),
        ("extproc.routing.router", "extproc.servicer", "<lambda>"),  # the router calls the transport back
        ("extproc.servicer", "extproc.tracking", "note"),  # note -> inner: one module, one entry
    ]
    assert (walk.num_modules, walk.num_entries, walk.num_reentries, walk.num_from_below) == (3, 4, 1, 1)
    assert walk.modules == [SERVICER, ROUTER, TRACKING]
    assert walk.num_calls == 5 and walk.background == {POOL: 1}


async def test_nothing_is_counted_outside_the_package_or_the_window() -> None:
    f = stand_ins()
    walk = wm.Walk("t")
    with wm.ModuleTracer(package="elsewhere").window(walk):
        f["handle"]()
    f["handle"]()  # no window open
    assert walk.entries == [] and walk.num_calls == 0


async def test_a_task_the_walk_creates_is_the_walks_and_its_resumption_no_entry() -> None:
    f = stand_ins()
    walk = wm.Walk("t")
    with wm.ModuleTracer().window(walk):
        assert await f["handle_async"]() == 1
    # The router's coroutine runs in its own task, with no repository frame below it: adopted, not background.
    assert sequence(walk) == [("outside", "extproc.servicer", "handle_async"),
                              ("outside", "extproc.routing.router", "later")]
    assert walk.num_calls == 4 and walk.background == {}  # later's decide and lambda: calls within the router
    assert [(r.module, r.caller) for r in walk.resumptions] == [(SERVICER, None)]  # after awaiting the task


async def test_a_stream_walk_keeps_to_its_handlers_task() -> None:
    f = stand_ins()
    walk = wm.Walk("t")

    async def handler() -> None:
        f["handle"]()
        await asyncio.sleep(0)
        f["handle"]()

    async def other_call() -> None:  # another call on the same port while the stream waits
        f["handle"]()

    with wm.ModuleTracer().window(walk, one_task=True):
        stream = asyncio.get_running_loop().create_task(handler())
        await asyncio.sleep(0)
        await asyncio.get_running_loop().create_task(other_call())
        await stream
    assert walk.task is stream
    assert walk.num_entries == 8 and walk.background[SERVICER] == 2  # the other call's handle and lambda


def test_a_joined_walk_counts_reentries_across_both() -> None:
    entry = wm.Entry
    first = wm.Walk("a", entries=[entry(SERVICER, "f", None, False, False), entry(ROUTER, "g", SERVICER, False, False)])
    second = wm.Walk("b", entries=[entry(TRACKING, "h", None, False, False), entry(ROUTER, "g", TRACKING, False, False)])
    both = first.joined(second, "a+b")
    assert (both.num_modules, both.num_entries, both.num_reentries) == (3, 4, 1)
    assert both.num_reentries == both.num_entries - both.num_modules
