"""Waiting in tests: on the condition itself, with a deadline, never on the clock alone.

A test that must wait for something (a coordinator to reach a step, a chunk to be back in
the queue, a file to appear) polls that condition until it holds or a deadline passes,
and then fails with a message naming what it waited for. It returns as soon as the
condition holds, however fast or slow the machine: unlike a fixed sleep, which hopes the
other side is done by then. Where the protocol itself gives an order (frames on one
connection are handled in order, so a reply means every earlier frame was handled) or an
end (EOF on a socket, an asyncio.Event), tests wait on that instead of polling.
"""

import asyncio
import inspect
import time

POLL_S = 0.01  # how often a condition is looked at; not how long anything is given


def _describe(what) -> str:
    return what() if callable(what) else what


def wait_until(predicate, timeout: float, what, interval: float = POLL_S):
    """Call `predicate()` until it returns a true value, and return that value.

    After `timeout` seconds: AssertionError naming `what` (a string, or a function giving
    one, called only then so it can show the state at the deadline). An AssertionError
    raised by `predicate` itself (an invariant checked on every poll) propagates at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        if value := predicate():
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {_describe(what)}")
        time.sleep(interval)  # a poll interval: the loop ends on the condition or the deadline


async def async_wait_until(predicate, timeout: float, what, interval: float = POLL_S):
    """wait_until for a coroutine: the event loop runs on between polls. `predicate` may
    be a plain function or return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {_describe(what)}")
        await asyncio.sleep(interval)  # a poll interval, as above
